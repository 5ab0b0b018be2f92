"""Where the GPU-seconds go (``hetpipe_jax.core.breakdown``) and efficiency against the ideal aggregate
(``python -m hetpipe_jax.efficiency``)."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, run_hetpipe, synthetic
from hetpipe_jax.core.breakdown import CATEGORIES, shares, time_breakdown
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.models import FULL_SIZE
from hetpipe_jax.plan.costmodel import ideal_images_per_sec, standalone_images_per_sec

from helpers import assert_trace_ok, meta, schedule_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hand_trace():
  """One VW, 2 stages, Nm = 1, D = 0: minibatch 1 through the pipeline (ends at 4, pushed at 4), the gate
  closed from 4 to 4.5, the pull travelling until 5, minibatch 2's forward on stage 0 from 5 to 6."""
  return [
      meta(1, [1], 0, [2], executor="sim"),
      {"ev": "inject", "vw": 0, "mb": 1, "t": 0.0},
      {"ev": "fwd", "vw": 0, "stage": 0, "mb": 1, "t0": 0.0, "t1": 1.0, "own": 0, "glob": [0]},
      {"ev": "fwd", "vw": 0, "stage": 1, "mb": 1, "t0": 1.0, "t1": 2.0, "own": 0, "glob": [0]},
      {"ev": "bwd", "vw": 0, "stage": 1, "mb": 1, "t0": 2.0, "t1": 3.0, "own": 0, "glob": [0]},
      {"ev": "bwd", "vw": 0, "stage": 0, "mb": 1, "t0": 3.0, "t1": 4.0, "own": 0, "glob": [0]},
      {"ev": "complete", "vw": 0, "mb": 1, "t": 4.0},
      {"ev": "push", "vw": 0, "wave": 0, "t": 4.0},
      {"ev": "wait", "vw": 0, "t0": 4.0, "t1": 4.5},
      {"ev": "pull", "vw": 0, "t": 5.0, "glob": [1]},
      {"ev": "inject", "vw": 0, "mb": 2, "t": 5.0},
      {"ev": "fwd", "vw": 0, "stage": 0, "mb": 2, "t0": 5.0, "t1": 6.0, "own": 1, "glob": [1]},
  ]


def test_a_hand_worked_trace_splits_into_the_right_states():
  out = time_breakdown(hand_trace())
  assert out["seconds"] == 6.0
  dev0, dev1 = (d["seconds"] for d in out["devices"])
  # stage 0: 3 tasks; idle 1-3 for stage 1's gradient, with Nm = 1 in flight (so no forward may enter: the
  # window); 4-4.5 at the gate; 4.5-5 the pull travels
  assert {c: s for c, s in dev0.items() if s} == {"compute": 3.0, "window": 2.0, "gate": 0.5, "pull": 0.5}
  # stage 1: waits 0-1 for its input, 2 tasks, nothing more to do from 3 on
  assert {c: s for c, s in dev1.items() if s} == {"compute": 2.0, "bubble": 1.0, "done": 3.0}
  # with a known compute time, the rest of each task is the link (its input received in series)
  dev0 = time_breakdown(hand_trace(), compute=lambda i, j, kind: 0.75)["devices"][0]["seconds"]
  assert dev0["compute"] == pytest.approx(2.25) and dev0["link"] == pytest.approx(0.75)


def test_a_wider_nm_window_turns_window_time_into_compute():
  """4 stages: with Nm = 1 stage 0 waits for each minibatch's gradient before the next may enter; Nm = 4
  fills the pipeline, and stage 0's waiting for the window mostly goes."""
  narrow, wide = (time_breakdown(schedule_only([4], [nm], 0, 8 // nm, [1.0])) for nm in (1, 4))
  share = lambda out, c: out["devices"][0]["seconds"][c] / out["seconds"]
  assert share(narrow, "window") > 0.5 and share(wide, "window") < share(narrow, "window") / 2
  assert share(wide, "compute") > share(narrow, "compute")
  for out in (narrow, wide):
    for device in out["devices"]:
      assert sum(device["seconds"].values()) == pytest.approx(out["seconds"])


@pytest.mark.parametrize("executor,rejoin", [("virtual", False), ("wall", True)])
def test_every_gpu_second_is_accounted_for_with_failures(executor, rejoin):
  result = run_hetpipe(get_model("mlp"), synthetic(num_train=256), RunConfig.of(
      cluster="hetero4", num_vws=3, stages=2, nm=2, d=1, waves=8, batch_size=16, executor=executor,
      failures=((1, 3),), rejoin=rejoin, eval_every=100))
  assert_trace_ok(result.events)
  out = time_breakdown(result.events)
  for device, fraction in zip(out["devices"], shares(out)):
    assert sum(fraction.values()) == pytest.approx(1.0), device
    assert set(fraction) == set(CATEGORIES) and min(fraction.values()) >= 0
  assert all(d["seconds"]["left"] == 0 for d in out["devices"] if d["vw"] != 1)
  if not rejoin:  # VW 1 is out from its failure to the end
    leave = next(e["t"] for e in result.events if e["ev"] == "leave")
    assert all(d["seconds"]["left"] == pytest.approx(out["seconds"] - leave) for d in out["devices"] if d["vw"] == 1)


def test_the_ideal_aggregate_is_the_sum_of_standalone_rates():
  cluster = get_cluster("paper_testbed")
  profiles = full_size_profiles("vgg19", 32)
  one = {g.type.name: standalone_images_per_sec(profiles, g, 32) for g in cluster.gpus}
  assert ideal_images_per_sec(cluster, profiles, 32) == pytest.approx(4 * sum(one.values()))  # 4 of each
  # BUILD_NOTES' figure with the calibrated catalogue (725.5 at the old uniform efficiency 0.5)
  assert ideal_images_per_sec(cluster, profiles, 32) == pytest.approx(1937.4, abs=0.5)


@pytest.mark.parametrize("gpu,published", [("TITAN V", 107), ("TITAN RTX", 129), ("V100", 155)])
def test_the_calibrated_catalogue_reproduces_the_figures_it_cites(gpu, published):
  """ResNet-152, batch 32, FP32 (Lambda, TensorFlow 1.12, 2019): the catalogue's resnet efficiency was fitted
  to these, rounded to two digits."""
  from hetpipe_jax.cluster import CATALOGUE, Gpu
  profiles = full_size_profiles("resnet152", 32)
  assert {p.family for p in profiles} == {"resnet"}
  rate = standalone_images_per_sec(profiles, Gpu(0, CATALOGUE[gpu], 0), 32)
  assert rate == pytest.approx(published, rel=0.01)
  # the image models; the GPTs take each type's default factor (no transformer figure is calibrated)
  assert {name for name, spec in FULL_SIZE.items() if spec.dtype == "float32"} == {
      "vgg16", "vgg19", "resnet50", "resnet101", "resnet152", "inception_v3"}


@pytest.mark.slow
def test_the_cli_reports_efficiency_of_a_sim_trace(tmp_path):
  trace = tmp_path / "trace.jsonl"
  run = subprocess.run([sys.executable, "-m", "experiments.train", "--executor=sim", "--model=vgg19",
                        "--cluster=paper_testbed", "--policy=ED", "--placement=local", "--waves=20",
                        f"--out_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.efficiency", str(trace)], capture_output=True,
                        text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads((tmp_path / "trace.efficiency.json").read_text())
  assert report["images_per_sec"] == pytest.approx(summary["images_per_second"], rel=1e-9)
  assert report["efficiency"] == pytest.approx(report["images_per_sec"] / report["ideal_images_per_sec"])
  assert 0 < report["efficiency"] < 1
  assert (tmp_path / "trace.efficiency.png").stat().st_size > 0
  assert f"efficiency {report['efficiency']:.3f}" in proc.stdout
  for fraction in report["shares"]:
    assert sum(fraction.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("arg,message", [("0", "TIME_SCALE='0'"), ("x", "TIME_SCALE='x'")])
def test_a_bad_time_scale_is_one_line(tmp_path, arg, message):
  trace = tmp_path / "t.jsonl"
  trace.write_text("\n".join(json.dumps(e) for e in hand_trace()) + "\n")
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.efficiency", str(trace), arg], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_padded_wall_trace_gets_efficiency_with_its_time_scale():
  """A wall run padded to the emulated durations (time_scale: wall seconds per emulated second) is read on
  the emulated clock when its time_scale is given, and gets no efficiency without it."""
  from hetpipe_jax.efficiency import efficiency_report

  result = run_hetpipe(get_model("mlp"), synthetic(num_train=256), RunConfig.of(
      cluster="hetero4", num_vws=2, stages=2, nm=2, d=1, waves=4, batch_size=16, executor="wall",
      time_scale=2000.0, eval_every=100))
  assert_trace_ok(result.events)
  unscaled = efficiency_report(result.events)
  assert "efficiency" not in unscaled and "time_scale" in unscaled["note"]
  report = efficiency_report(result.events, time_scale=2000.0)
  assert 0 < report["efficiency"] < 1.5  # on the emulated clock (CPU noise may pad a task beyond its cost)
  assert report["images_per_sec"] == pytest.approx(result.images / (report["seconds"] / 2000.0))
  for fraction in report["shares"]:
    assert sum(fraction.values()) == pytest.approx(1.0)


def test_a_cluster_that_is_not_a_preset_is_passed_along(tmp_path):
  """A trace of a run on a cluster from a TOML file names it by its name only: the report gets no cost model
  from the name, and the whole report from the cluster given beside the trace (a Cluster or the file)."""
  from hetpipe_jax.efficiency import efficiency_report

  toml = tmp_path / "lab.toml"
  toml.write_text('name = "lab"\n[[nodes]]\ngpus = ["TITAN V", "TITAN V"]\n[[nodes]]\ngpus = ["RTX 2060"]\n')
  cluster = get_cluster(str(toml))
  result = run_hetpipe(get_model("mlp"), synthetic(num_train=256), RunConfig.of(
      cluster=cluster, executor="sim", num_vws=1, stages=3, nm=2, waves=4, batch_size=16))
  assert_trace_ok(result.events)
  assert "unknown cluster 'lab'" in efficiency_report(result.events)["note"]
  for given in (cluster, str(toml)):
    report = efficiency_report(result.events, cluster=given)
    assert report["note"] is None and 0 < report["efficiency"] < 1
    assert report["images_per_sec"] == pytest.approx(result.images_per_second)
  with pytest.raises(ConfigError, match="ran on cluster 'lab', not on the given 'hetero4'"):
    efficiency_report(result.events, cluster="hetero4")
