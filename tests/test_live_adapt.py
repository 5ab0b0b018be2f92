"""HetPipe adapting live across processes (issue 39, item 3; :mod:`hetpipe_jax.run.executors.live_replan`): the run
in parts of ``--replan_every`` waves in the same processes, each part's trace checked, the next part's layout
planned on what the last one measured, its weights and minibatch streams going on."""

import json
import re

import numpy as np
import pytest

from hetpipe_jax import RunConfig, get_model, read_trace, run_hetpipe, synthetic
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core.schedule import Task
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.run.executors.live_replan import check, measured_slowness

from helpers import TWO_NODES, assert_trace_ok, train_cli

GPU = GpuType("g", 1 << 34, 1e12, 1e12, 1e15, 1.0)
LINK = Link("l", 1e10, 0.0)
DEEP = "examples.residual_mlp:deep"  # 12 units: room to re-cut


def test_measured_slowness_is_each_stages_time_over_its_emulated_time():
  # stage 0 (GPU 0) emulated 1 s a task x time_scale 0.01, took 0.03 s each: 3; stage 1 (GPUs 2 and 3, split)
  # emulated 2 s x 0.01, took 0.02 s and 0.03 s: 0.05 / 0.04 = 1.25, for both its GPUs
  cluster = make_cluster("four", [[GPU, GPU], [GPU, GPU]], LINK, LINK)
  g = cluster.gpus
  layout = Layout((VWLayout((g[0], g[2]), (0, 1, 2), 1, tp=((), (g[3],))),))
  events = [{"ev": "fwd", "vw": 0, "stage": 0, "mb": 1, "t0": 0.0, "t1": 0.03},
            {"ev": "bwd", "vw": 0, "stage": 0, "mb": 1, "t0": 1.0, "t1": 1.03},
            {"ev": "fwd", "vw": 0, "stage": 1, "mb": 1, "t0": 0.1, "t1": 0.12},
            {"ev": "bwd", "vw": 0, "stage": 1, "mb": 1, "t0": 0.5, "t1": 0.53},
            {"ev": "push", "vw": 0, "wave": 0, "t": 2.0}]
  cost = lambda task: 1.0 if task.stage == 0 else 2.0
  assert measured_slowness(events, cost, 0.01, layout) == pytest.approx({0: 3.0, 2: 1.25, 3: 1.25})
  assert cost(Task(0, 0, "fwd", 1)) == 1.0


def test_streams_after_go_on_where_the_last_part_left_off():
  data = synthetic(num_train=512)
  streams = MinibatchStreams(data, 32, 2, seed=5)
  later = streams.after([3, 7])
  for vw, taken in ((0, 3), (1, 7)):
    for mb in (1, 2, 9):
      np.testing.assert_array_equal(later(vw, mb)[0], streams(vw, mb + taken)[0])
  assert streams.after([0, 0])(1, 4)[1].tolist() == streams(1, 4)[1].tolist()


@pytest.mark.parametrize("flags, message", [
    (("--adapt=on",), "give --time_scale > 0"),
    (("--adapt=on", "--time_scale=100", "--ps_optimizer=delayed_nesterov"), "give --ps_optimizer=add"),
    (("--adapt=on", "--time_scale=100", "--fail=0@2"), "a failed one would be back at the next: drop adapt"),
    (("--adapt=on", "--time_scale=100", "--rejoin"), "continues one trace over its parts: drop adapt"),
    (("--replan_every=0",), "replan_every=0; give a number of waves >= 1"),
    (("--replan_every=4", "--time_scale=100"), "replan_every=4 paces HetPipe's adaptation, which this run does not "
                                               "do (adapt=auto): give --adapt=on, or drop replan_every"),
])
def test_a_bad_live_adaptation_is_one_line(tmp_path, flags, message):
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", *flags,
                   f"--cluster={TWO_NODES}", "--num_vws=1", "--stages=2", "--waves=4", timeout=120)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_the_sim_executor_refuses_replan_every_without_adapting(tmp_path):
  proc = train_cli(tmp_path, "--executor=sim", "--model=resnet152", "--replan_every=3", "--num_vws=1", "--stages=2",
                   "--waves=2", timeout=120)
  assert proc.returncode != 0 and "replan_every=3 paces HetPipe's adaptation" in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_a_time_model_is_refused_in_one_line():
  with pytest.raises(ConfigError, match="time_model='vgg19' times another: drop --time_model, or --adapt=off"):
    check(RunConfig.of(executor="multiprocess", adapt="on", time_scale=100.0, time_model="vgg19"))


def test_executors_without_numerics_over_processes_refuse_replan_every(tmp_path):
  proc = train_cli(tmp_path, "--executor=virtual", "--dataset=synthetic", "--model=mlp", "--replan_every=3",
                   "--num_vws=1", "--stages=2", "--waves=2", timeout=120)
  assert proc.returncode != 0 and "replan_every is a model of the sim executor" in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def _parts(path) -> list[list[dict]]:
  meta = read_trace(str(path / "trace.jsonl"))[0]
  out = []
  for k in range(len(meta["segments"])):
    name = "trace.jsonl" if k == 0 else f"trace.layout{k + 1}.jsonl"
    out.append(read_trace(str(path / name)))
  return out


@pytest.mark.slow  # (two processes, three runs: about 40 s)
def test_a_slowed_process_is_re_planned_around_live_and_plain_sgd_is_kept(tmp_path):
  """Node 0 (7 of the deep residual MLP's 12 units) slowed 3x for the whole run: after its first part the adapting
  run measures stage 0 at about 3, compiles a re-cut with fewer units on node 0 while the second part trains, and
  runs it from the third; every part's trace checks on its own. With Nm = 1 and D = 0 (plain SGD whatever the
  timing and the cuts) its losses are those of one process: the weights and the minibatch streams go on across
  the parts. Without --adapt the layout stays."""
  flags = ("--num_vws=1", "--stages=2", "--nm=1", "--d=0", "--waves=15", "--batch_size=32", "--seed=3",
           "--time_scale=10000", "--slow=0:3@0-1e9")
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", f"--model={DEEP}",
                   f"--cluster={TWO_NODES}", *flags, "--adapt=on", "--replan_every=3", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  parts = _parts(tmp_path)
  for events in parts:
    assert_trace_ok(events)
  on_node0 = [next(cuts[j + 1] - cuts[j] for j, gpu in enumerate(meta["gpus"][0]) if gpu.startswith("n0."))
              for meta, cuts in ((p[0], p[0]["cuts"][0]) for p in parts)]
  assert on_node0[0] == 7 and on_node0[-1] < 7, on_node0  # node 0 holds fewer units once re-planned
  measured = [float(m) for m in re.findall(r"adapt: measured slowness \{0: ([0-9.]+)", proc.stderr)]
  assert measured and min(measured) > 2.5, measured  # (3 x, a real delay per task, measured)
  meta = parts[0][0]
  assert sum(s["minibatches"] for s in meta["segments"]) == 15
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["wave"] for r in rows] == list(range(15)) and [r["step"] for r in rows] == list(range(1, 16))
  single = run_hetpipe(get_model(DEEP), synthetic(), RunConfig.of(
      cluster="uniform8", num_vws=1, stages=2, nm=1, d=0, waves=15, batch_size=32, seed=3, cuts=[[0, 7, 12]]))
  np.testing.assert_allclose([r["train_loss"] for r in rows], [r["train_loss"] for r in single.metrics], rtol=1e-5)
  kept = train_cli(tmp_path / "off", "--executor=multiprocess", "--dataset=synthetic", f"--model={DEEP}",
                   f"--cluster={TWO_NODES}", *flags, "--waves=3", timeout=300)
  assert kept.returncode == 0, kept.stderr[-3000:]
  assert "segments" not in read_trace(str(tmp_path / "off" / "trace.jsonl"))[0]
