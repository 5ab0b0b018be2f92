"""The peers on the simulator (hetpipe_jax.baselines): a hand-worked case per peer, the all-reduce against its
closed form, the batch split against brute force, timelines that account for every GPU-second."""

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.baselines.collective import allreduce
from hetpipe_jax.baselines.hetero_dp import _Speed, split_batch
from hetpipe_jax.baselines.horovod import allreduce_seconds, horovod_iteration_seconds
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker, simulate_sync
from hetpipe_jax.baselines.sync_pipeline import proportional
from hetpipe_jax.baselines.timeline import CATEGORIES, timeline_report
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.cost.batch import BatchProfiles, fixed
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.sim.network import Simulator
from hetpipe_jax.systems import WSP, get_system, systems

SYSTEMS = [name for name, system in systems().items() if system.kind != WSP]  # the peers


def simulate_peer(name, *args):
  return get_system(name).simulate(*args)

FAST = GpuType("fast", 1 << 36, 10e12, 10e12, 1e18, 1.0)
SLOW = GpuType("slow", 1 << 36, 5e12, 5e12, 1e18, 1.0)
PCIE, NET = Link("pcie", 10e9, 1e-5), Link("net", 1e9, 1e-4)
# at batch 32: forward 1 Tflop and backward 2 Tflop per unit (fast: 0.1 s and 0.2 s; slow: 0.2 s and 0.4 s),
# 100 MB and 300 MB of weights, a 10 MB activation between them; memory bandwidth so high that flops decide
UNITS = [UnitProfile("u0", 1e12, 2e12, 1, 1, 100_000_000, 10_000_000, 0),
         UnitProfile("u1", 1e12, 2e12, 1, 1, 300_000_000, 10_000_000, 0)]
PROFILES = fixed(UNITS, 32)
TWO_NODES = make_cluster("fast+slow", [[FAST], [SLOW]], PCIE, NET)


def _ring_seconds(cluster, gpus, num_bytes):
  sim = Simulator(cluster)
  ends = []
  allreduce(sim, gpus, num_bytes, ends.append)
  sim.drain()
  return ends[0]


@pytest.mark.parametrize("shape", [[[FAST] * 4], [[FAST] * 2, [SLOW] * 2], [[FAST] * 2, [SLOW] * 2, [FAST] * 2],
                                   [[FAST], [SLOW], [FAST]]])
def test_ring_allreduce_alone_equals_its_closed_form(shape):
  cluster = make_cluster("c", shape, PCIE, NET)
  gpus = list(cluster.gpus)
  assert _ring_seconds(cluster, gpus, 4e8) == pytest.approx(allreduce_seconds(cluster, gpus, 4e8), rel=1e-9)


def test_two_allreduces_on_one_link_share_it():
  # two rings over the same two nodes at once: each step's flows share the nodes' ports, so both end when one
  # alone would have moved twice the bytes
  sim = Simulator(TWO_NODES)
  ends = []
  allreduce(sim, list(TWO_NODES.gpus), 2e8, ends.append)
  allreduce(sim, list(TWO_NODES.gpus), 2e8, ends.append)
  sim.drain()
  alone = allreduce_seconds(TWO_NODES, list(TWO_NODES.gpus), 2e8)  # 2 steps of 1e-4 s + 100 MB at 1 GB/s
  assert ends == pytest.approx([2 * alone - 2e-4] * 2)


def test_horovod_by_hand():
  # slow GPU: forward 0.4 s, u1's backward done at 0.8, u0's at 1.2; each tensor is over 64 MiB, so alone in
  # its buffer: u1 (300 MB) all-reduced 0.8 -> 1.1002 (2 steps of 1e-4 + 150 MB at 1 GB/s), u0 1.2 -> 1.3002
  run = simulate_peer("horovod", TWO_NODES, PROFILES, 32)
  assert run.round_seconds == pytest.approx(1.3002)
  assert run.images_per_sec == pytest.approx(64 / 1.3002)
  overlap = horovod_iteration_seconds(TWO_NODES, UNITS, list(TWO_NODES.gpus), overlap=True)
  assert run.round_seconds == pytest.approx(overlap)  # the closed form, where no flows contend
  assert run.efficiency == pytest.approx(64 / 1.3002 / (32 / 0.6 + 32 / 1.2))


def test_hetero_dp_by_hand():
  # 64 examples: fast takes 0.01875 s an example, slow 0.0375; the minimax split is 43 / 21 (0.80625 s vs
  # 0.7875 s; 42 / 22 would take 0.825 s). u1's gradient is ready at max(0.5375, 0.525), negotiated at the
  # next 1 ms cycle (0.538), all-reduced until 0.8382; u0 ready at 0.80625 waits for it: 0.8382 + 0.1002
  run = simulate_peer("hetero_dp", TWO_NODES, PROFILES, 32)
  assert run.timeline["meta"]["shares"] == [43, 21]
  assert run.timeline["meta"]["accumulation"] == [1, 1]
  assert run.round_seconds == pytest.approx(0.9384)
  assert run.images_per_sec == pytest.approx(64 / 0.9384)


def test_hetero_dp_split_is_the_brute_force_minimax():
  cluster = make_cluster("three", [[FAST, SLOW], [SLOW]], PCIE, NET)
  small: dict[str, int] = {"fast": 16, "slow": 5}  # memory for at most 16 / 5 examples at once: accumulation
  profiles = fixed([UnitProfile("u", 1e11, 2e11, 1, 1, 1000, 1, 1 << 30)], 1)
  types = {g.type.name: GpuType(g.type.name, (small[g.type.name] << 30) + 4000, g.type.fp32_flops,
                                g.type.fp16_flops, g.type.mem_bytes_per_s, 1.0) for g in cluster.gpus}
  cluster = make_cluster("three", [[types["fast"], types["slow"]], [types["slow"]]], PCIE, NET)
  split = split_batch(list(cluster.gpus), profiles, 40)
  assert sum(s for _, s, _ in split) == 40
  speed = {g.type.name: _Speed(profiles, g.type, small[g.type.name], "fp32") for g in cluster.gpus}
  best = min(max(speed[g.type.name](s) for g, s in zip(cluster.gpus, shares))
             for shares in itertools.product(range(41), repeat=3) if sum(shares) == 40)
  assert max(speed[g.type.name](s) for g, s, _ in split) == pytest.approx(best)
  assert all(a == -(-s // small[g.type.name]) for g, s, a in split)  # accumulation steps: ceil(share / memory)


def test_pipelines_by_hand():
  # two pipelines (fast -> slow) in two nodes, 2 microbatches each under 1F1B, weights on u1 only. Stage 1:
  # F1 0.10101 (after the 10 MB activation: 1e-5 + 1 ms) - 0.30101, B1 - 0.70101, F2 - 0.90101, B2 - 1.30101;
  # u1's all-reduce between the slow GPUs (one per node) from the next cycle, 1.302, for 0.3002 s
  units = [dataclasses.replace(UNITS[0], param_bytes=0), UNITS[1]]
  cluster = make_cluster("2x2", [[FAST, SLOW], [FAST, SLOW]], PCIE, NET)
  g = cluster.gpus
  workers = (Worker((g[0], g[1]), (0, 1, 2), 64, 2, 2), Worker((g[2], g[3]), (0, 1, 2), 64, 2, 2))
  result = simulate_sync(SyncJob("sync_pipeline", cluster, workers, fixed(units, 32)))
  assert result.round_seconds == pytest.approx(1.6022)
  assert result.images_per_sec == pytest.approx(128 / 1.6022)
  report = timeline_report({**result.timeline, "meta": {**result.timeline["meta"]}})
  fast = report["shares"][0]  # stage 0: F1, F2 (0.2 s), B1, B2 (0.4 s) of 2 x 1.6022 s; the rest idle
  assert fast["compute"] == pytest.approx(0.6 / 1.6022)
  assert fast["allreduce"] == 0  # it holds no weights: after its last backward it waits for the others
  assert fast["sync"] == pytest.approx((1.6022 - 1.50202) / 1.6022)


def test_pipeline_allreduces_that_share_the_network():
  # the same pipelines, u0 with its 100 MB of weights too: its all-reduce (between the fast GPUs) starts at
  # 1.503 while u1's second ring step (150 MB each way, from 1.4522) is under way; they share both nodes'
  # ports at 0.5 GB/s each. By hand: u0's step 1 ends 1.6031, u0's step 2 starts 1.6032 beside u1's last
  # 49.0 MB, which end at 1.7012; u0's last 1 MB alone: 1.7022
  cluster = make_cluster("2x2", [[FAST, SLOW], [FAST, SLOW]], PCIE, NET)
  g = cluster.gpus
  workers = (Worker((g[0], g[1]), (0, 1, 2), 64, 2, 2), Worker((g[2], g[3]), (0, 1, 2), 64, 2, 2))
  result = simulate_sync(SyncJob("sync_pipeline", cluster, workers, PROFILES))
  assert result.round_seconds == pytest.approx(1.7022, abs=1e-7)


def test_local_sgd_by_hand():
  # H = 2: fast done at 1.2 s, slow at 2.4; then the weight changes, u0 (100 MB) then u1 (300 MB): 2.8004
  run = simulate_peer("local_sgd", TWO_NODES, PROFILES, 32, PeerKnobs(local_steps=2))
  assert run.round_seconds == pytest.approx(2.8004)
  assert run.images_per_sec == pytest.approx(128 / 2.8004)
  # H by speed: the slow GPU takes 1 local step, both are done at 1.2 s
  run = simulate_peer("local_sgd", TWO_NODES, PROFILES, 32, PeerKnobs(local_steps=2, h_by_speed=True))
  assert run.timeline["meta"]["local_steps"] == [2, 1]
  assert run.round_seconds == pytest.approx(1.6004)
  assert run.images_per_sec == pytest.approx(96 / 1.6004)


def test_gpipe_by_hand():
  # fast -> slow, one unit each, 4 microbatches of 8 (a quarter of a unit's batch-32 flops each: fast 0.025 s
  # forward, 0.05 backward; slow twice that), 2.5 MB activations over the 1 GB/s network (1e-4 + 2.5e-3)
  run = simulate_peer("gpipe", TWO_NODES, PROFILES, 8, PeerKnobs(microbatches=4))
  assert run.job.workers[0].cuts == (0, 1, 2) and run.job.schedule == "gpipe" and run.job.recompute
  # slow: forwards at 0.0276 + 0.05 k (k = 0..3, each after its input lands; the 4th ends 0.2276), then its
  # backwards, the first three with their forward again (0.15 each), the last without (0.1): ends 0.7776; that
  # gradient lands on fast at 0.7802 (fast ran B1..B3 as theirs landed) and fast's last backward takes 0.05
  assert run.round_seconds == pytest.approx(0.2276 + 3 * 0.15 + 0.1 + 0.0026 + 0.05)
  slow = [(a, b) for d, a, b, cat, label in run.timeline["intervals"] if d == 1 and label.startswith("B")]
  assert [round(b - a, 6) for a, b in slow[:4]] == [0.15, 0.15, 0.15, 0.1]
  with pytest.raises(ConfigError, match="give global_batch >= microbatches"):
    simulate_peer("gpipe", TWO_NODES, PROFILES, 8, PeerKnobs(microbatches=4, global_batch=2))
  with pytest.raises(ConfigError, match="3 GPUs for a model of 2 units"):
    simulate_peer("gpipe", make_cluster("3", [[FAST], [FAST], [SLOW]], PCIE, NET), PROFILES, 8)


def test_ps_sync_by_hand():
  # u0 (100 MB) on the PS task of node 0, u1 (300 MB) on node 1's (round-robin). u1 is done on both GPUs at
  # 0.8 s (the slow one's backward 0.4..1.2, u1 first): fast pushes over the network (0.3001, lands 1.1001),
  # slow over its PCIe; u0 at 1.2: slow pushes over the network (0.1001, lands 1.3001). Then the pulls, all on
  # separate resources: u1 to the fast GPU over the network, 0.3001: the step ends at 1.6002
  run = simulate_peer("ps_sync", TWO_NODES, PROFILES, 32)
  assert run.round_seconds == pytest.approx(1.6002)
  assert run.images_per_sec == pytest.approx(64 / 1.6002)
  assert run.timeline["meta"]["ps_tasks"] == 2


def test_tf_replicated_by_hand():
  # the slow GPU's backward ends at 1.2; then u0 (100 MB) and u1 (300 MB) are all-reduced one after another,
  # each alone: 2 steps of 1e-4 + 50 MB at 1 GB/s to 1.3002, then 2 steps of 1e-4 + 150 MB to 1.6004
  run = simulate_peer("tf_replicated", TWO_NODES, PROFILES, 32)
  assert run.round_seconds == pytest.approx(1.6004)
  # without NCCL, on one node of two fast GPUs: the step ends at 0.6, both push both units to the host's task
  # (800 MB on its 10 GB/s PCIe, 0.08 + 1e-5), then both pull 400 MB each (the same again): 0.76002
  one_node = make_cluster("1x2", [[FAST, FAST]], PCIE, NET)
  assert simulate_peer("tf_replicated_copy", one_node, PROFILES, 32).round_seconds == pytest.approx(0.76002)


def test_ps_replicated_sums_inside_each_host_by_hand():
  # two hosts of two fast GPUs; u0's task on host 0, u1's on host 1. u1 is done everywhere at 0.4: each host
  # sums it over its PCIe (300 MB, 0.03001), host 0 pushes it over the network (0.3001, lands 0.73011), host 1
  # to itself; u0 at 0.6: summed (0.01001), host 1 pushes it over the network (lands 0.71011). The pulls start
  # at 0.73011; the last is u1 to host 0 over the network (0.3001) and its copy to host 0's other GPU (0.03001)
  cluster = make_cluster("2x2", [[FAST, FAST], [FAST, FAST]], PCIE, NET)
  run = simulate_peer("ps_replicated", cluster, PROFILES, 32)
  assert run.round_seconds == pytest.approx(1.06022)
  assert run.examples_per_round == 128
  # every GPU its own worker: four pushes and pulls of each unit, twice the network's bytes: slower
  assert simulate_peer("ps_sync", cluster, PROFILES, 32).round_seconds > 1.5


def test_local_sgd_auto_workers_are_gpus_where_one_holds_the_model_else_pipelines():
  gpu_run = simulate_peer("local_sgd", TWO_NODES, PROFILES, 32, PeerKnobs(local_workers="gpu"))
  auto_run = simulate_peer("local_sgd", TWO_NODES, PROFILES, 32, PeerKnobs(local_workers="auto"))
  assert auto_run.timeline["meta"]["local_workers"] == "gpu"
  assert auto_run.round_seconds == gpu_run.round_seconds
  # 1 GiB GPUs: neither holds both 400 MB units with their optimizer state, a two-GPU pipeline holds them
  tiny = GpuType("tiny", 1 << 30, 10e12, 10e12, 1e18, 1.0)
  big = fixed([dataclasses.replace(u, param_bytes=400_000_000) for u in UNITS], 32)
  cluster = make_cluster("tiny1x2", [[tiny, tiny]], PCIE, NET)
  with pytest.raises(ConfigError, match="no GPU holds the whole model"):
    simulate_peer("local_sgd", cluster, big, 32, PeerKnobs(local_workers="gpu"))
  run = simulate_peer("local_sgd", cluster, big, 32, PeerKnobs(local_workers="auto"))
  assert run.timeline["meta"]["local_workers"] == "vw" and len(run.job.workers[0].gpus) == 2


def test_sync_pipeline_splits_microbatches_by_speed():
  assert proportional(16, [2.0, 1.0, 1.0]) == [8, 4, 4]
  assert proportional(5, [10.0, 1.0]) == [4, 1]
  with pytest.raises(ConfigError, match="at least one each"):
    proportional(1, [1.0, 1.0])


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_every_peer_accounts_for_every_gpu_second(system):
  cluster = make_cluster("2x2", [[FAST, SLOW], [FAST, SLOW]], PCIE, NET)
  if system == "gpipe":  # (one pipeline over every GPU: one per unit)
    cluster = make_cluster("2x1", [[FAST], [SLOW]], PCIE, NET)
  run = simulate_peer(system, cluster, PROFILES, 32, PeerKnobs(local_steps=3, microbatches=6))
  report = timeline_report(run.timeline)
  assert set(report["categories"]) == set(CATEGORIES)
  for shares in report["shares"]:
    assert sum(shares.values()) == pytest.approx(1.0)
  assert 0 < run.efficiency <= 1.0
  assert run.examples_per_round == sum(w.examples_per_round for w in run.job.workers)


def test_bad_knobs_are_refused():
  for knobs, match in ((PeerKnobs(local_steps=0), "--local_steps=0"), (PeerKnobs(outer_momentum=1.0), "outer_momentum"),
                       (PeerKnobs(fusion_mb=-1), "fusion_mb"), (PeerKnobs(local_workers="x"), "local_workers")):
    with pytest.raises(ConfigError, match=match):
      simulate_peer("local_sgd", TWO_NODES, PROFILES, 32, knobs)
  with pytest.raises(ConfigError, match="unknown system"):
    simulate_peer("nope", TWO_NODES, PROFILES, 32)


def test_batch_profiles_follow_the_line_through_two_profiles():
  low = [UnitProfile("u", 10.0, 20.0, 5.0, 6.0, 100, 8, 4)]
  high = [UnitProfile("u", 20.0, 40.0, 7.0, 8.0, 100, 16, 8)]
  profiles = BatchProfiles(tuple(low), tuple(high), 8, 16)
  assert profiles.at(16) == tuple(high)
  u = profiles.at(4)[0]
  assert (u.fwd_flops, u.fwd_bytes, u.out_bytes, u.param_bytes) == (5.0, 4.0, 4, 100)
  with pytest.raises(ConfigError, match="batch size 0"):
    profiles.at(0)


@pytest.mark.slow
def test_baseline_cli_prints_images_per_sec_last_and_efficiency_reads_the_timeline(tmp_path):
  out = subprocess.run([sys.executable, "-m", "experiments.baseline", "--system=hetero_dp", "--model=resnet152",
                        f"--out_dir={tmp_path}"], capture_output=True, text=True, timeout=300, check=True).stdout
  last = out.strip().splitlines()[-1]
  assert last.startswith("images_per_sec=") and " efficiency=" in last
  ips, eff = (float(x.split("=")[1]) for x in last.split())
  assert ips > 0 and 0 < eff <= 1
  timeline = next(tmp_path.glob("*.timeline.json"))
  again = subprocess.run([sys.executable, "-m", "hetpipe_jax.efficiency", str(timeline)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
  assert f"efficiency {eff:.3f}" in again
  assert json.loads(next(tmp_path.glob("*.efficiency.json")).read_text())["system"] == "hetero_dp"
