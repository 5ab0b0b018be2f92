"""Every system adapting to GPUs whose speed varies (issue 39, item 2), each rule on a case worked by hand: the
peers re-size at every barrier from measured busy times (:mod:`hetpipe_jax.baselines.adapt`), HetPipe re-cuts its
stages and re-sizes its waves when it pays (:mod:`hetpipe_jax.sim.replan`)."""

import json
import re

import pytest

from hetpipe_jax.baselines.adapt import LocalSteps, Microbatches, least_slowest
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import Worker
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.cost.batch import fixed
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.sim import SimJob, SimOptions
from hetpipe_jax.sim.replan import Replanning, simulate_replanning
from hetpipe_jax.systems.registry import get_system

from helpers import assert_trace_ok, train_cli

GPU = GpuType("g", 1 << 34, 1e12, 1e12, 1e15, 1.0)
LINK = Link("l", 1e10, 0.0)
CLUSTER = make_cluster("four", [[GPU, GPU], [GPU, GPU]], LINK, LINK)
TWO = make_cluster("two", [[GPU], [GPU]], LINK, LINK)
# at batch 32 each unit takes 0.1 s forward and 0.2 s backward on a GPU, holds 1 MB of weights
UNITS = [UnitProfile(f"u{i}", 1e11, 2e11, 0, 0, 1_000_000, 8, 0) for i in range(6)]
HALF_GPU0 = "persist=0@0:0.5"  # GPU 0 at half its speed from the start: nothing else varies


def test_least_slowest_gives_each_item_to_who_finishes_it_first():
  # worker 0 takes m x 1 s, worker 1 (m + 2) x 0.5 s: [4, 6] ends both at 4 s; any other split ends later
  assert least_slowest(10, [0, 2], [1.0, 0.5]) == [4, 6]


def test_microbatches_are_resplit_by_measured_time_with_the_flush():
  # two 2-stage pipelines of 4 microbatches busy 5 s and 10 s: (4 + 1) x t gives t = 1 s and 2 s a microbatch;
  # 8 microbatches: [6, 2] ends at 7 s and 6 s ([5, 3]: 6 s and 8 s; [7, 1]: 8 s)
  a, b = Worker(CLUSTER.gpus[:2], (0, 3, 6), 4 * 32, 4), Worker(CLUSTER.gpus[2:], (0, 3, 6), 4 * 32, 4)
  resized = Microbatches(8).resize([a, b], [5.0, 10.0])
  assert [(w.microbatches, w.batch) for w in resized] == [(6, 6 * 32), (2, 2 * 32)]


def test_local_steps_follow_measured_speed():
  # H 8 and 8 done in 1 s and 2 s: the fastest keeps 8, the other 4
  workers = [Worker((g,), (0, 6), 32, local_steps=8) for g in TWO.gpus]
  assert [w.local_steps for w in LocalSteps(8).resize(workers, [1.0, 2.0])] == [8, 4]


def _peer(name, adapt, **knobs):
  return get_system(name).simulate(TWO, fixed(UNITS, 32), 32, PeerKnobs(noise=HALF_GPU0, adapt=adapt, rounds=4,
                                                                        **knobs))


def test_hetero_dp_rebalances_its_batch_as_lb_bsp_does():
  # 64 examples on two equal GPUs, GPU 0 at half speed: its profile predicts c per example, it is timed at 2c, so
  # its slowness is 2; the minimax split of 2c x s0 against c x s1 is [21, 43] (42c and 43c; [22, 42]: 44c)
  off, on = _peer("hetero_dp", "off"), _peer("hetero_dp", "on")
  assert off.batch_sizes == (32, 32) and on.meta["adapted"] == {"rule": "batch", "shares": [21, 43]}
  assert on.batch_sizes == (21, 43) and on.images_per_sec > 1.3 * off.images_per_sec


def test_local_sgd_resizes_h_by_measured_speed():
  on = _peer("local_sgd", "on", local_workers="gpu", h_by_speed=True, local_steps=8)
  assert on.meta["adapted"] == {"rule": "local_steps", "local_steps": [4, 8]} and on.local_steps == (4, 8)
  assert _peer("local_sgd", "off", local_workers="gpu", h_by_speed=True).local_steps == (8, 8)


def test_without_noise_auto_does_not_adapt_and_on_changes_nothing_here():
  quiet = get_system("hetero_dp").simulate(TWO, fixed(UNITS, 32), 32, PeerKnobs())
  assert "adapted" not in quiet.meta and quiet.meta["rounds"] == 2
  on = get_system("hetero_dp").simulate(TWO, fixed(UNITS, 32), 32, PeerKnobs(adapt="on"))
  assert on.meta["adapted"]["shares"] == [32, 32] and on.images_per_sec == pytest.approx(quiet.images_per_sec)


def _hetpipe_job(noise):
  # two virtual workers of two stages, three units a stage; 20 waves of 2
  vws = (VWLayout(CLUSTER.gpus[:2], (0, 3, 6), 2), VWLayout(CLUSTER.gpus[2:], (0, 3, 6), 2))
  return SimJob(CLUSTER, fixed(UNITS, 32).at(32), Layout(vws), 0, 20, options=SimOptions(noise=noise))


def test_hetpipe_recuts_a_slowed_stage_and_pays_the_move():
  # GPU 0 at half speed: its three units take 6 unit-times against GPU 1's 3. The planner on the measured view
  # cuts VW 0 so that both stages take 4: two units on GPU 0 (4) and four on GPU 1, or GPU 1 first with four and
  # GPU 0 after with two. The move: the units whose GPU changes carry 1 MB x (1 + 1 slot) each.
  job = _hetpipe_job(HALF_GPU0)
  segments = simulate_replanning(job, CostContext(optimizer_slots=1.0), Replanning(every=5))
  assert len(segments) == 2 and segments[1].layout.vws[1] == job.layout.vws[1]
  vw0 = segments[1].layout.vws[0]
  options: dict[tuple, int] = {((0, 1), (0, 2, 6)): 1, ((1, 0), (0, 4, 6)): 5}
  moved = options[tuple(g.index for g in vw0.gpus), vw0.cuts]
  assert segments[1].moved_bytes == pytest.approx(moved * 2e6)
  for s in segments:
    assert_trace_ok(s.trace.events)
  assert segments[1].start > segments[0].end  # the move took time on the links
  waves = [s.minibatches // 4 for s in segments]  # (both virtual workers' pushed waves of 2)
  assert min(waves[0], 5) == 5 and sum(waves) >= 20
  adapted = sum(s.minibatches for s in segments) / segments[-1].end
  fixed_run = simulate_replanning(job, CostContext(optimizer_slots=1.0), Replanning(every=1000))
  assert len(fixed_run) == 1 and adapted > 1.1 * fixed_run[0].minibatches / fixed_run[0].end


def test_hetpipe_keeps_its_layout_when_nothing_varies_or_it_does_not_pay():
  for noise in ("none", "jitter=0.01,seed=3"):
    segments = simulate_replanning(_hetpipe_job(noise), CostContext(), Replanning(every=5))
    assert len(segments) == 1 and segments[0].minibatches == 2 * 20 * 2


def test_hetpipe_system_records_its_layouts_in_the_trace():
  run = get_system("hetpipe").simulate(CLUSTER, fixed(UNITS, 32), 32,
                                       PeerKnobs(policy="NP", noise=HALF_GPU0, adapt="on"))
  meta = run.events[0]
  assert len(meta["segments"]) >= 1 and meta["segments"][0]["start"] == 0.0
  assert_trace_ok(run.events)


@pytest.mark.slow  # (12 s: the fast suite's limit)
def test_the_sim_executor_replans_under_noise_and_writes_each_layouts_trace(tmp_path):
  # ED on the paper testbed, GPU 4 (stage 0 of the first virtual worker) at a quarter of its speed from 1 s on
  flags = ("--executor=sim", "--model=vgg19", "--cluster=paper_testbed", "--policy=ED", "--waves=60",
           "--noise=persist=4@1:0.25")
  proc = train_cli(tmp_path / "on", *flags)
  assert proc.returncode == 0, proc.stderr[-2000:]
  traces = sorted((tmp_path / "on").glob("trace*.jsonl"))
  assert [p.name for p in traces][:2] == ["trace.jsonl", "trace.layout2.jsonl"]
  events = [[json.loads(line) for line in p.read_text().splitlines()] for p in traces]
  for e in events:
    assert_trace_ok(e)
  segments = events[0][0]["segments"]
  assert len(segments) == len(traces) and segments[1]["start"] >= segments[0]["end"]
  assert segments[1]["cuts"][0] != segments[0]["cuts"][0] and segments[1]["moved_bytes"] > 0
  off = train_cli(tmp_path / "off", *flags, "--adapt=off")
  rate = [float(re.search(r"; ([\d.]+) images/s", p.stdout).group(1)) for p in (proc, off)]
  assert rate[0] > 1.2 * rate[1]
  refused = train_cli(tmp_path / "fast", *flags, "--fast_sim")
  assert refused.returncode != 0 and "give --adapt=off, or drop fast_sim" in refused.stderr
