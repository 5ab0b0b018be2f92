"""The cost formulas, each written once: optimizer slots, stage memory, the boundary-transfer rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import memory_bytes, nbytes, optimizer_slots_of, param_copies, stage_memory_bytes
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.cost.roofline import stage_compute_seconds
from hetpipe_jax.cost.transfer import (
  Receive,
  link_seconds,
  receive_seconds,
  receive_seconds_by_position,
  stage_seconds,
  stage_transfers,
  transfer_seconds,
)
from hetpipe_jax.models import get_model
from hetpipe_jax.optim import OPTIMIZERS, make_optimizer, optimizer_slots
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout, VWLayout

GPU = GpuType("g", 1 << 33, 1e12, 1e12, 1e11, 1.0)
PCIE, NET = Link("pcie", 10e9, 1e-5), Link("net", 1e9, 1e-4)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_registered_slots_equal_the_measured_state_size(name):
  model = get_model("cnn")
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 28, 28, 1)))
  tx = make_optimizer(name, 0.1)
  measured = nbytes(jax.eval_shape(tx.init, params)) / nbytes(params)
  assert optimizer_slots_of(tx, params) == measured
  if name == "muon":  # one momentum per matrix entry, Adam's two moments on every other parameter (here conv kernels)
    leaves = jax.tree.leaves(params)
    other = sum(p.size for p in leaves if p.ndim != 2) / sum(p.size for p in leaves)
    scalars = (measured - optimizer_slots(name) - other) * nbytes(params)  # the registry: matrices alone
    assert 0 <= scalars <= 64  # beside them only a few scalar step counts (bytes)
    return
  assert optimizer_slots(name) == pytest.approx(measured, rel=0.01, abs=0.01)


def test_memory_formula_on_scalars_and_arrays():
  assert param_copies(1, CostContext("stash", 0)) == 3 and param_copies(4, CostContext("stash", 2)) == 8
  assert param_copies(4, CostContext(weight_mode="latest", optimizer_slots=1.5)) == 3.5
  params, kept = np.array([1_000, 5_000, 0]), np.array([10, 0, 70])
  for nm, mode, slots in ((1, "stash", 0), (3, "stash", 2), (3, "latest", 1)):
    costs = CostContext(weight_mode=mode, optimizer_slots=slots)
    vector = memory_bytes(params, kept, nm, costs)
    assert list(vector) == [memory_bytes(int(p), int(k), nm, costs) for p, k in zip(params, kept)]
    units = [UnitProfile(f"u{i}", 0, 0, 0, 0, int(p), 0, int(k)) for i, (p, k) in enumerate(zip(params, kept))]
    assert stage_memory_bytes(units, nm, costs) == int(vector.sum())  # linear: per unit or per stage


def test_transfer_rule_by_hand():
  cluster = make_cluster("c", [[GPU, GPU], [GPU]], PCIE, NET)
  a, b, c = cluster.gpus
  assert link_seconds(NET, 1e9) == pytest.approx(1.0001)
  assert transfer_seconds(cluster, a, b, 1e9) == pytest.approx(1e-5 + 0.1)  # same node: PCIe
  assert transfer_seconds(cluster, a, c, 1e9) == pytest.approx(1.0001)  # across nodes
  assert transfer_seconds(cluster, a, a, 1e9) == 0.0  # same GPU
  units = [UnitProfile(f"u{i}", 1e9, 2e9, 0, 0, 0, 1_000_000 * (i + 1), 0) for i in range(4)]
  gpus = [a, c, b]
  # stage 1 holds units 1..2: the activation of unit 0 from a before its forward, the gradient of its
  # last unit (2) from b before its backward.
  assert stage_transfers(units, [0, 1, 3, 4], gpus, 1) == (Receive(1_000_000, a), Receive(3_000_000, b))
  assert stage_transfers(units, [0, 1, 3, 4], gpus, 0) == (None, Receive(1_000_000, c))
  assert stage_transfers(units, [0, 1, 3, 4], gpus, 2) == (Receive(3_000_000, c), None)
  # Nothing crosses at cut positions 0 and num_units (only empty stages sit beyond them).
  assert stage_transfers(units, [0, 0, 4, 4], gpus, 1) == (None, None)
  fwd, bwd = stage_seconds(cluster, units, [0, 1, 3, 4], gpus, 1)
  compute = stage_compute_seconds(units, [0, 1, 3, 4], c, 1)
  assert fwd == pytest.approx(compute[0] + 1e-4 + 1e6 / 1e9) and bwd == pytest.approx(compute[1] + 1e-4 + 3e6 / 1e9)
  by_position = receive_seconds_by_position(cluster, units, a, c)
  assert by_position[0] == by_position[4] == 0.0
  assert list(by_position[1:4]) == [receive_seconds(cluster, Receive(units[p - 1].out_bytes, a), c)
                                    for p in range(1, 4)]
  assert not receive_seconds_by_position(cluster, units, None, c).any()


@pytest.mark.parametrize("seed", range(5))
def test_cost_model_times_are_the_stage_times(seed):
  rng = np.random.default_rng(seed)
  cluster = make_cluster("c", [[GPU, GPU], [GPU, GPU]], PCIE, NET)
  units = [UnitProfile(f"u{i}", *rng.uniform(1e9, 1e10, 2), *rng.uniform(1e6, 1e8, 2), 1000,
                       int(rng.integers(1e5, 1e7)), 1000) for i in range(6)]
  gpus = list(rng.permutation(cluster.gpus))
  layout = Layout((VWLayout(tuple(gpus[:3]), (0, 2, 5, 6), 2), VWLayout(tuple(gpus[3:]), (0, 6), 1)))
  cost = CostModel(cluster, units, layout)
  for i, vw in enumerate(layout.vws):
    for j in range(vw.k):
      times = stage_seconds(cluster, units, vw.cuts, vw.gpus, j)
      compute = stage_compute_seconds(units, vw.cuts, vw.gpus[j], j)
      for kind, t, c, recv in zip(("fwd", "bwd"), times, compute, stage_transfers(units, vw.cuts, vw.gpus, j)):
        assert cost.task_seconds(i, j, kind) == t and cost.compute_seconds(i, j, kind) == c
        assert cost.transfer(i, j, kind) == (None if recv is None else (recv.num_bytes, recv.src, vw.gpus[j]))
