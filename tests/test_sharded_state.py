"""Sharded state for data parallelism (issue 38, item 3): ZeRO stage 2 in the memory model, and hetero_dp's GPUs
that shard the gradient and the optimizer state among them, worked by hand."""

import pytest

from hetpipe_jax.baselines.hetero_dp import hetero_dp_job, sharded_split
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import GIB, LINKS, GpuType, make_cluster
from hetpipe_jax.cost.batch import fixed
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import param_copies
from hetpipe_jax.cost.unit import UnitProfile

ADAM = CostContext(weight_mode="latest", optimizer_slots=2)
BIG = GpuType("Big", 8 * GIB, 1e13, 1e13, 5e11)
# 1 GiB of weights, 1 MiB kept per example, 0.03 s of compute per example on either type
PROFILES = fixed([UnitProfile("u", 1e11, 2e11, 1e6, 2e6, GIB, 1 << 10, 1 << 20)], 1)


def cluster_with(small_gib: float, inter_node: str = "ib_hdr200"):
  small = GpuType("Small", int(small_gib * GIB), 1e13, 1e13, 5e11)
  return make_cluster("big_small", [[BIG, BIG], [small, small]], LINKS["nvlink2"], LINKS[inter_node])


def test_a_replica_keeps_the_weights_and_its_share_of_the_gradient_and_the_optimizer_state():
  assert param_copies(1, ADAM) == 4  # weights, gradient, Adam's two slots
  assert param_copies(1, ADAM._replace(state_shards=4)) == 1 + 3 / 4
  assert param_copies(2, CostContext(optimizer_slots=1, state_shards=2)) == 1 + 2 / 2 + 2  # stashed stay whole


@pytest.mark.parametrize("small_gib, shards", [
    (2.2, 4),  # 1 + 3/4 GiB and the activations fit 2.2 GiB: all four shard the state
    (1.6, 2),  # at 4 shards 1.75 GiB does not fit 1.6 GiB: the big two, at 2 shards
])
def test_the_shards_are_the_gpus_that_hold_their_share(small_gib, shards):
  costs, split = sharded_split(list(cluster_with(small_gib).gpus), PROFILES, 32, ADAM)
  assert costs.state_shards == len(split) == shards and sum(s for _, s, _ in split) == 32


@pytest.mark.parametrize("inter_node, gpus", [
    ("ib_hdr200", 4),  # 24 GB/s between nodes: the small GPUs' share of compute is worth the longer ring
    ("eth10", 2),  # 1.25 GB/s: a ring of 1 GiB across nodes costs more than the compute it saves
])
def test_hetero_dp_shards_its_state_where_that_is_faster(inter_node, gpus):
  cluster = cluster_with(2.2, inter_node)
  plain = hetero_dp_job(cluster, PROFILES, 8, PeerKnobs(), ADAM)
  assert [w.gpus[0].type.name for w in plain.workers] == ["Big", "Big"]  # 4 GiB of state: the big ones only
  job = hetero_dp_job(cluster, PROFILES, 8, PeerKnobs(shard_state=True), ADAM)
  knobs = dict(job.knobs)
  assert len(job.workers) == knobs["gpus"] == gpus and knobs.get("state_shards", 1) == (4 if gpus == 4 else 1)
  assert knobs["global_batch"] == 32
