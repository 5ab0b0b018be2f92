"""The signature-state partitioning DP equals the old enumeration of device orders, choice for choice.

``reference_search`` is the enumerating search the DP replaced (every distinct order of the GPUs'
(type, node) signatures, depth-first with shared rows): on random small virtual worker the DP must find
the same bottleneck (and, as it breaks ties the same way, the same order and cuts), in seconds and in the
memory-ratio fallback, with and without empty stages, feasible or not.
"""

import numpy as np
import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.cluster import GIB, LINKS, GpuType, make_cluster
from hetpipe_jax.cluster.catalogue import CATALOGUE
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.cost.transfer import stage_seconds
from hetpipe_jax.plan import partition as partition_module
from hetpipe_jax.plan.partition import partition


def reference_search(dp, gpus, mem_ratio=False):
  """The old exact search: every distinct order of signatures, depth-first; (value, order, cuts)."""
  k, n = len(gpus), dp.n
  best = {"value": np.inf, "order": None, "cuts": None}

  def finish(order, rows, args):
    if rows[-1][n] < best["value"]:
      cuts, e = [n], n
      for j in range(k - 1, -1, -1):
        e = int(args[j][e])
        cuts.append(e)
      best.update(value=float(rows[-1][n]), order=list(order), cuts=cuts[::-1])

  def extend(order, rows, args, j):
    prev = rows[-1] if rows else np.where(np.arange(n + 1) == 0, 0.0, np.inf)
    cand = np.maximum(prev[:, None], dp.stage_matrix(order, j, mem_ratio))
    return rows + [cand.min(axis=0)], args + [cand.argmin(axis=0)]

  groups = {}
  for g in gpus:
    groups.setdefault((g.type.name, g.node), []).append(g)
  counts = dict.fromkeys(groups, 0)

  def rec(order, rows, args):
    if len(order) == k:
      rows, args = extend(order, rows, args, k - 1)
      finish(order, rows, args)
      return
    for key, members in groups.items():
      if counts[key] < len(members):
        counts[key] += 1
        nxt = order + [members[counts[key] - 1]]
        r, a = (rows, args) if len(nxt) < 2 else extend(nxt, rows, args, len(nxt) - 2)
        if not (r and np.isinf(r[-1]).all()):
          rec(nxt, r, a)
        counts[key] -= 1

  rec([], [], [])
  return best["value"], best["order"], best["cuts"]


CATALOGUE_TYPES = sorted(CATALOGUE)


def random_case(seed):
  """A random virtual worker of 2-6 GPUs on 1-4 nodes, catalogue and made-up types, random units."""
  rng = np.random.default_rng(seed)
  num_units = int(rng.integers(2, 10))
  scale = rng.uniform(0.02, 0.6)  # small scales make memory infeasible cases
  def unit(i):
    f, b = rng.uniform(1e9, 1e12, 2)
    fb, bb = rng.uniform(1e6, 1e9, 2)
    return UnitProfile(f"u{i}", f, b, fb, bb, int(rng.integers(10**6, 5 * 10**8)), int(rng.integers(10**5, 10**8)),
                       int(rng.integers(10**6, 2 * 10**9)))

  profiles = [unit(i) for i in range(num_units)]
  made_up = [GpuType(f"X{t}", int(rng.uniform(0.5, 4) * GIB * scale * 10), rng.uniform(1, 20) * 1e12, 1e13,
                     rng.uniform(100, 900) * 1e9, 0.5) for t in range(2)]
  pool = made_up + [CATALOGUE[CATALOGUE_TYPES[int(i)]] for i in rng.choice(len(CATALOGUE_TYPES), 3)]
  num_nodes = int(rng.integers(1, 5))
  per_node = [[pool[int(rng.integers(len(pool)))] for _ in range(int(rng.integers(1, 4)))] for _ in range(num_nodes)]
  cluster = make_cluster("random", per_node, LINKS["pcie3"], LINKS[["eth10", "ib_fdr56"][seed % 2]])
  num_gpus = int(rng.integers(2, min(6, cluster.num_gpus) + 1)) if cluster.num_gpus >= 2 else 1
  gpus = [cluster.gpus[int(i)] for i in sorted(rng.choice(cluster.num_gpus, num_gpus, replace=False))]
  if seed % 3 == 0:
    gpus = [gpus[int(i)] for i in rng.permutation(len(gpus))]
  allow_empty = bool(seed % 4 == 1) or num_gpus > num_units
  return cluster, profiles, gpus, int(rng.integers(1, 4)), allow_empty


@pytest.mark.parametrize("seed", range(120))
def test_dp_equals_enumeration(seed):
  cluster, profiles, gpus, nm, allow_empty = random_case(seed)
  dp = partition_module._Dp(cluster, profiles, nm, CostContext("stash", 2.0), allow_empty)
  for mem_ratio in (False, True):
    want = reference_search(dp, gpus, mem_ratio)
    got = partition_module._search(dp, gpus, ordered=False, mem_ratio=mem_ratio)
    if np.isinf(want[0]):
      assert np.isinf(got[0])
      continue
    assert got[0] == pytest.approx(want[0], rel=1e-9)
    # Same tie-breaking as the enumeration: the first optimal order depth-first, its first-index cuts.
    assert [g.index for g in got[1]] == [g.index for g in want[1] or []]
    assert got[2] == want[2]


@pytest.mark.parametrize("seed", range(120, 180))
def test_partition_plans_are_valid_and_reach_the_optimum(seed):
  cluster, profiles, gpus, nm, allow_empty = random_case(seed)
  dp = partition_module._Dp(cluster, profiles, nm, CostContext("stash", 2.0), allow_empty)
  want = reference_search(dp, gpus)[0]
  if np.isinf(want):
    with pytest.raises(ConfigError, match="fits in memory"):
      partition(cluster, profiles, gpus, nm, allow_empty=allow_empty, costs=CostContext(optimizer_slots=2.0))
    return
  plan = partition(cluster, profiles, gpus, nm, allow_empty=allow_empty, costs=CostContext(optimizer_slots=2.0))
  cuts = plan.cuts
  assert cuts[0] == 0 and cuts[-1] == len(profiles)
  assert all(a <= b if allow_empty else a < b for a, b in zip(cuts, cuts[1:]))
  assert sorted(g.index for g in plan.gpus) == sorted(g.index for g in gpus)
  for j, gpu in enumerate(plan.gpus):
    need = stage_memory_bytes(profiles[cuts[j]:cuts[j + 1]], nm, CostContext("stash", 2.0))
    assert need <= gpu.type.memory_bytes
  slowest = max(sum(stage_seconds(cluster, profiles, cuts, plan.gpus, j)) for j in range(len(gpus)))
  assert slowest == pytest.approx(want, rel=1e-9)
  assert plan.bottleneck_s == pytest.approx(want, rel=1e-9)


def test_random_cases_cover_infeasible_ties_and_empty_stages():
  infeasible = empty = shared = 0
  for seed in range(120):
    cluster, profiles, gpus, nm, allow_empty = random_case(seed)
    dp = partition_module._Dp(cluster, profiles, nm, CostContext("stash", 2.0), allow_empty)
    infeasible += np.isinf(reference_search(dp, gpus)[0])
    empty += allow_empty
    shared += len(partition_module._signature_groups(gpus)) < len(gpus)
  assert 10 < infeasible < 100 and empty > 20 and shared > 10


def sixteen_gpus():
  """4 nodes of 4 GPUs, 8 types, 2 GPUs of each type on one node: 8 signatures of 2 (16!/2^8 orders)."""
  names = ["TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000", "V100", "A100", "T4", "RTX 3090"]
  types = [CATALOGUE[name] for name in names]
  return make_cluster("sixteen", [[types[(4 * node + i) // 2] for i in range(4)] for node in range(4)])


def test_sixteen_gpus_of_eight_types_resnet152():
  from hetpipe_jax.cost.profile import full_size_profiles

  profiles = full_size_profiles("resnet152", 32)
  cluster = sixteen_gpus()
  plan = partition(cluster, profiles, list(cluster.gpus), 1, CostContext(optimizer_slots=1.0))
  cuts = plan.cuts
  assert cuts[0] == 0 and cuts[-1] == len(profiles) and all(a < b for a, b in zip(cuts, cuts[1:]))
  assert sorted(g.index for g in plan.gpus) == list(range(16))
  for s in plan.stages:
    assert s.memory_bytes <= s.gpu.type.memory_bytes
  # No better than the best fixed order we can name, and as good as the order it chose.
  dp = partition_module._Dp(cluster, profiles, 1, CostContext("stash", 1.0), False)
  for order in partition_module._bound_orders(dp, list(cluster.gpus)):
    assert plan.bottleneck_s <= partition_module._ordered(dp, order)[0] * (1 + 1e-12)
