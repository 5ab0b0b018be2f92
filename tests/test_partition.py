"""The partitioner: its DP equals brute force, memory accounting, Nm choice, infeasible plans."""

import dataclasses
import itertools

import numpy as np
import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.cluster import GIB, LINKS, GpuType, make_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.cost.transfer import stage_seconds
from hetpipe_jax.cost.unit import Recomputed
from hetpipe_jax.plan import partition as partition_module
from hetpipe_jax.plan.partition import partition, plan_virtual_worker
from hetpipe_jax.recompute import allowed_modes


def random_instance(rng, num_units, num_gpus):
  profiles = [UnitProfile(f"u{i}", *(rng.uniform(1e9, 1e11, 2)), *(rng.uniform(1e6, 1e9, 2)),
                          int(rng.integers(1e6, 5e8)), int(rng.integers(1e5, 1e8)), int(rng.integers(1e6, 1e9)))
              for i in range(num_units)]
  types = [GpuType(f"T{t}", int(rng.uniform(0.5, 4) * GIB), rng.uniform(1, 20) * 1e12, 1e13,
                   rng.uniform(100, 900) * 1e9, 0.5) for t in range(3)]
  per_node = [[types[int(rng.integers(3))] for _ in range(int(rng.integers(1, 3)))]
              for _ in range(num_gpus)]
  cluster = make_cluster("random", per_node, LINKS["pcie3"], LINKS["eth10"])
  gpus = list(rng.choice(cluster.gpus, size=num_gpus, replace=False))
  return cluster, profiles, sorted(gpus, key=lambda g: g.index)


def brute_force(cluster, profiles, gpus, nm, slots, ordered=False, allow_empty=False, modes=("none",)):
  """Every order, every cut and every stage's recomputation among ``modes``, evaluated with the public stage time
  and memory functions."""
  n, best = len(profiles), np.inf
  cuts = (itertools.combinations_with_replacement(range(n + 1), len(gpus) - 1) if allow_empty
          else itertools.combinations(range(1, n), len(gpus) - 1))
  cuts = list(cuts)
  under = {m: [u.under(m) for u in profiles] for m in modes}
  costs = CostContext(weight_mode="stash", optimizer_slots=slots)
  for order in ([gpus] if ordered else itertools.permutations(gpus)):
    for inner in cuts:
      cut = [0, *inner, n]
      for chosen in itertools.product(modes, repeat=len(order)):
        if any(stage_memory_bytes(under[m][cut[j]:cut[j + 1]], nm, costs) > g.type.memory_bytes
               for j, (g, m) in enumerate(zip(order, chosen))):
          continue
        best = min(best, max(sum(stage_seconds(cluster, under[m], cut, order, j)) for j, m in enumerate(chosen)))
  return best


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
  rng = np.random.default_rng(seed)
  num_units, num_gpus = int(rng.integers(1, 9)), int(rng.integers(1, 5))
  num_gpus = min(num_gpus, num_units)
  cluster, profiles, gpus = random_instance(rng, num_units, num_gpus)
  nm, ordered = int(rng.integers(1, 4)), bool(seed % 5 == 0)
  want = brute_force(cluster, profiles, gpus, nm, 2.0, ordered)
  if np.isinf(want):
    with pytest.raises(ConfigError, match="fits in memory"):
      partition(cluster, profiles, gpus, nm, ordered=ordered, costs=CostContext(optimizer_slots=2.0))
    return
  plan = partition(cluster, profiles, gpus, nm, ordered=ordered, costs=CostContext(optimizer_slots=2.0))
  assert plan.bottleneck_s == pytest.approx(want, rel=1e-9)
  assert plan.cuts[0] == 0 and plan.cuts[-1] == num_units
  assert sorted(g.index for g in plan.gpus) == [g.index for g in gpus]
  for s in plan.stages:
    assert s.memory_bytes <= s.gpu.type.memory_bytes


@pytest.mark.parametrize("seed", range(16))
def test_dp_with_recomputation_equals_brute_force(seed):
  """recompute=auto: every stage the fastest mode that fits, as the brute force over every stage's mode finds;
  the plan's stages say which mode each took, and their times and memory are those of that mode."""
  rng = np.random.default_rng(300 + seed)
  num_units = int(rng.integers(1, 7))
  cluster, profiles, gpus = random_instance(rng, num_units, min(int(rng.integers(1, 4)), num_units))
  profiles = with_recomputation(rng, profiles)
  nm, recompute = int(rng.integers(1, 4)), ["auto", "full", "selective", "auto"][seed % 4]
  costs = CostContext(optimizer_slots=2.0, recompute=recompute)
  want = brute_force(cluster, profiles, gpus, nm, 2.0, modes=allowed_modes(recompute))
  if np.isinf(want):
    with pytest.raises(ConfigError, match="fits in memory"):
      partition(cluster, profiles, gpus, nm, costs=costs)
    return
  plan = partition(cluster, profiles, gpus, nm, costs=costs)
  assert plan.bottleneck_s == pytest.approx(want, rel=1e-9)
  for j, s in enumerate(plan.stages):
    assert s.recompute in allowed_modes(recompute)
    mine = [u.under(s.recompute) for u in profiles]
    assert s.memory_bytes == stage_memory_bytes(mine[s.first:s.last], nm, costs) <= s.gpu.type.memory_bytes
    assert s.seconds == pytest.approx(sum(stage_seconds(cluster, mine, plan.cuts, plan.gpus, j)), rel=1e-12)
  assert plan.layout.unit_recompute() == [s.recompute for s in plan.stages for _ in range(s.first, s.last)]


@pytest.mark.parametrize("seed", range(10))
def test_dp_equals_brute_force_with_empty_stages(seed):
  rng = np.random.default_rng(100 + seed)
  cluster, profiles, gpus = random_instance(rng, int(rng.integers(1, 4)), int(rng.integers(2, 5)))
  want = brute_force(cluster, profiles, gpus, 1, 0.0, allow_empty=True)
  if np.isinf(want):
    with pytest.raises(ConfigError, match="fits in memory"):
      partition(cluster, profiles, gpus, 1, allow_empty=True)
    return
  plan = partition(cluster, profiles, gpus, 1, allow_empty=True)
  assert plan.bottleneck_s == pytest.approx(want, rel=1e-9)


def with_recomputation(rng, profiles):
  """The profiles with random selective and full recomputation costs: more backward work, fewer kept bytes."""
  def recomputed(u, share):
    return Recomputed(u.bwd_flops + share * u.fwd_flops, u.bwd_bytes + share * u.fwd_bytes,
                      int(u.kept_bytes * (1 - share) * rng.uniform(0.2, 1.0)))
  return [dataclasses.replace(u, selective=recomputed(u, 0.2), full=recomputed(u, 1.0)) for u in profiles]


@pytest.mark.parametrize("seed", range(20))
def test_dp_matrices_equal_the_scalar_stage_time_and_memory(seed):
  """The DP's vectorised T_j(s, e) and M(s, e) are stage_seconds and stage_memory_bytes at every cut, under the
  recomputation asked for; under auto, T_j is the fastest mode whose memory fits."""
  rng = np.random.default_rng(200 + seed)
  num_units = int(rng.integers(1, 9))
  cluster, profiles, gpus = random_instance(rng, num_units, int(rng.integers(1, 5)))
  profiles = with_recomputation(rng, profiles)
  gpus = list(rng.permutation(gpus))  # any pipeline order, several GPUs of one node or type included
  nm, mode, slots = int(rng.integers(1, 4)), ["stash", "latest"][seed % 2], float(rng.uniform(0, 2.5))
  recompute = ["none", "selective", "full", "auto"][seed % 4]
  costs = CostContext(mode, slots, recompute=recompute)
  dp = partition_module._Dp(cluster, profiles, nm, costs, allow_empty=True)
  modes = allowed_modes(recompute)
  assert [m.mode for m in dp.modes(gpus[0])] == list(modes)
  for j, gpu in enumerate(gpus):
    times = dp.stage_matrix(gpus, j)
    for s in range(num_units + 1):
      for e in range(s, num_units + 1):
        want = np.inf
        for m, mode_dp in zip(modes, dp.modes(gpu)):
          mine = [u.under(m) for u in profiles]
          need = stage_memory_bytes(mine[s:e], nm, costs)
          assert mode_dp.memory[s, e] == pytest.approx(need, rel=1e-12, abs=1)
          if need <= gpu.type.memory_bytes:
            cut = [0] * j + [s, e] + [num_units] * (len(gpus) - j - 1)
            want = min(want, sum(stage_seconds(cluster, mine, cut, gpus, j)))
        assert times[s, e] == pytest.approx(want, rel=1e-12)


def test_some_random_instances_are_infeasible():
  infeasible = 0
  for seed in range(40):
    rng = np.random.default_rng(seed)
    num_units = int(rng.integers(1, 9))
    cluster, profiles, gpus = random_instance(rng, num_units, min(int(rng.integers(1, 5)), num_units))
    infeasible += np.isinf(brute_force(cluster, profiles, gpus, int(rng.integers(1, 4)), 2.0, seed % 5 == 0))
  assert 0 < infeasible < 40  # the comparison above covers both outcomes


def two_layers():
  # Unit 0: 1 MB of parameters, 10 MB kept; unit 1: 2 MB and 20 MB.
  return [UnitProfile("a", 1e9, 2e9, 1e6, 1e6, 1_000_000, 4_000, 10_000_000),
          UnitProfile("b", 1e9, 2e9, 1e6, 1e6, 2_000_000, 4_000, 20_000_000)]


def test_memory_accounting_by_hand():
  units = two_layers()
  # params x (weights + wave accumulator + 2 Adam slots + Nm stashed copies) + Nm x kept
  assert stage_memory_bytes(units, nm=1, costs=CostContext("stash", 2)) == 3e6 * 5 + 30e6
  assert stage_memory_bytes(units, nm=3, costs=CostContext("stash", 2)) == 3e6 * 7 + 3 * 30e6
  assert stage_memory_bytes(units, nm=3, costs=CostContext("latest", 2)) == 3e6 * 4 + 3 * 30e6
  assert stage_memory_bytes(units[:1], nm=2, costs=CostContext("stash", 0)) == 1e6 * 4 + 2 * 10e6


def _cluster(mem_a, mem_b):
  a = GpuType("fast", int(mem_a), 10e12, 10e12, 500e9, 1.0)
  b = GpuType("slow", int(mem_b), 2e12, 2e12, 500e9, 1.0)
  return make_cluster("two", [[a], [b]])


def test_fast_gpu_gets_more_work_and_order_is_searched():
  units = [UnitProfile(f"u{i}", 1e10, 2e10, 1e6, 1e6, 1000, 1000, 1000) for i in range(6)]
  cluster = _cluster(GIB, GIB)
  plan = partition(cluster, units, list(cluster.gpus), nm=1)
  sizes = {s.gpu.type.name: s.last - s.first for s in plan.stages}
  assert sizes == {"fast": 5, "slow": 1}


def test_nm_policies():
  units = two_layers()
  cluster = _cluster(60e6, 60e6)  # each GPU holds one unit at Nm <= 2 (unit b: 2e6*(2+1) + 2*20e6 = 46e6)
  assert plan_virtual_worker(cluster, units, list(cluster.gpus), "max_fit", nm_max=8).nm == 2
  assert plan_virtual_worker(cluster, units, list(cluster.gpus), 1).nm == 1
  best = plan_virtual_worker(cluster, units, list(cluster.gpus), "best", nm_max=8)
  assert best.nm == 2 and best.throughput == pytest.approx(min(1 / best.bottleneck_s, 2 / best.latency_s))


def test_infeasible_plan_names_device_need_and_capacity():
  units = two_layers()
  cluster = _cluster(20e6, 20e6)
  with pytest.raises(ConfigError, match=r"no partition of the model over 2 GPUs .* fits in memory with Nm=1: "
                                        r"the least-loaded cut still needs 24.8 MiB on n1.slow.1 "
                                        r"\(slow, 19.1 MiB\) for units 1..1; use more or larger GPUs"):
    partition(cluster, units, list(cluster.gpus), nm=1)
  with pytest.raises(ConfigError, match="only 2 units to cut"):
    partition(make_cluster("three", [[GpuType("g", GIB, 1e12, 1e12, 1e11)] * 3]), units,
              list(make_cluster("three", [[GpuType("g", GIB, 1e12, 1e12, 1e11)] * 3]).gpus), nm=1)
