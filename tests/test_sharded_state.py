"""Sharded state for data parallelism (issue 38, item 3): ZeRO stages 2 and 3 in the memory model and the sync
simulator, and hetero_dp's GPUs that shard the gradient and the optimizer state (and the weights) among them,
worked by hand."""

import dataclasses

import pytest

from hetpipe_jax.baselines.hetero_dp import fsdp_split, hetero_dp_job, sharded_split
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import FSDP_BYTES, SyncJob, Worker, simulate_sync
from hetpipe_jax.cluster import GIB, LINKS, GpuType, make_cluster
from hetpipe_jax.cost.batch import fixed
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import param_copies, stage_memory_bytes
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError

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


# ZeRO stage 3 (FSDP): the weights sharded too

EIGHTHS = fixed([UnitProfile(f"u{k}", 1e11 / 8, 2e11 / 8, 1e6, 2e6, GIB // 8, 1 << 10, 1 << 21) for k in range(8)], 1)


def test_sharded_weights_keep_a_share_of_everything_and_the_units_they_gather():
  costs = ADAM._replace(state_shards=4, shard_weights=True)
  assert param_copies(1, costs) == (1 + 1 + 2) / 4
  units = list(EIGHTHS.at(2))
  # 1 GiB x 4 copies / 4, three gathered eighths, 2 examples x 16 MiB kept (fp32)
  assert stage_memory_bytes(units, 1, costs) == GIB + 3 * (GIB // 8) + 2 * (1 << 24)
  mixed = costs._replace(precision="bf16")  # gathered and kept in 16 bits, the shards of state in fp32
  assert stage_memory_bytes(units, 1, mixed) == GIB + (3 * (GIB // 8) + 2 * (1 << 24)) // 2


def test_fsdp_takes_the_same_accumulation_steps_on_every_gpu_each_a_micro_step_its_memory_holds():
  # four 1.6 GiB GPUs: replicated (4 GiB) and ZeRO-2 (1.75 GiB) do not fit; ZeRO-3 over 4 keeps 1 GiB of state,
  # 3/8 GiB gathered and 16 MiB per example: 14 examples at once, so 128 take A = 4 micro-steps of 32 (A = 2:
  # 64 > 4 x 14)
  small = GpuType("Small", int(1.6 * GIB), 1e13, 1e13, 5e11)
  cluster = make_cluster("small4", [[small, small], [small, small]], LINKS["nvlink2"], LINKS["ib_hdr200"])
  costs, split = fsdp_split(list(cluster.gpus), EIGHTHS, 128, ADAM)
  assert (costs.state_shards, costs.shard_weights, {a for _, _, a in split}) == (4, True, {4})
  assert [s for _, s, _ in split] == [8, 8, 8, 8]
  with pytest.raises(ConfigError, match="hetero_dp: no GPU holds"):
    hetero_dp_job(cluster, EIGHTHS, 8, PeerKnobs(), ADAM)
  job = hetero_dp_job(cluster, EIGHTHS, 32, PeerKnobs(shard_state=True), ADAM)
  knobs = dict(job.knobs)
  assert job.weights_sharded and [(w.batch, w.local_steps) for w in job.workers] == [(8, 4)] * 4
  assert (knobs["global_batch"], knobs["shares"], knobs["accumulation"], knobs["state_shards"]) == \
      (128, [32] * 4, [4] * 4, 4)


def test_hetero_dp_takes_sharded_weights_where_only_they_let_the_small_gpus_in():
  cluster = cluster_with(1.6)  # ZeRO-2 at 4 shards needs 1.75 GiB: only the big two; ZeRO-3 takes all four
  job = hetero_dp_job(cluster, EIGHTHS, 8, PeerKnobs(shard_state=True), ADAM)
  knobs = dict(job.knobs)
  assert (knobs["gpus"], knobs.get("shard_weights"), knobs["global_batch"]) == (4, True, 32)


def test_every_micro_step_of_sharded_weights_ends_in_a_barrier_and_one_and_a_half_all_reduces():
  """A round of A micro-steps takes A rounds of one step whose all-reduce carries 1.5x the weights."""
  cluster = cluster_with(8, "eth10")  # the links matter: 1.25 GB/s between the nodes
  gpus, units = list(cluster.gpus), len(EIGHTHS.low)
  heavier = fixed([dataclasses.replace(u, param_bytes=int(u.param_bytes * FSDP_BYTES)) for u in EIGHTHS.low], 1)
  sharded = SyncJob("t", cluster, tuple(Worker((g,), (0, units), 4 + k, local_steps=3) for k, g in enumerate(gpus)),
                    EIGHTHS, rounds=2, weights_sharded=True)
  once = SyncJob("t", cluster, tuple(Worker((g,), (0, units), 4 + k) for k, g in enumerate(gpus)), heavier, rounds=2)
  a, b = simulate_sync(sharded), simulate_sync(once)
  assert a.examples_per_round == 3 * b.examples_per_round == 3 * (4 + 5 + 6 + 7)
  assert a.round_seconds == pytest.approx(3 * b.round_seconds, rel=1e-9)
  assert a.timeline["meta"]["rounds"] == 2
  with pytest.raises(ConfigError, match="sharded weights take workers of one GPU, the same local steps"):
    SyncJob("t", cluster, (Worker((gpus[0],), (0, units), 4, local_steps=2), Worker((gpus[1],), (0, units), 4)),
            EIGHTHS, weights_sharded=True)
