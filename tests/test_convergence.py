"""Convergence harness: runs learn, curves repeat with the seed, DP with one GPU is plain SGD, and the
cost-model time axis scales with the GPUs' speed."""

import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import optax
import pytest
from test_transparency import DATA as TDATA
from test_transparency import STEPS, plain_sgd

from experiments.convergence import print_perplexity
from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe, synthetic
from hetpipe_jax.baselines.data_parallel import train_data_parallel
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.studies.convergence_noise import noise_tables, seeded
from hetpipe_jax.studies.convergence_runs import ConvergenceRun, Outcome, WspStats
from hetpipe_jax.studies.convergence_summary import Unigram, summarise, table
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.studies.convergence_tuned import TunedPilot, fewest_examples, pilot_choices
from hetpipe_jax.systems import CurvePoint

from helpers import assert_trace_ok

FAST_LINKS = (Link("l", 1e18, 0.0), Link("l", 1e18, 0.0))


def cluster(speed=1.0):
  types = [GpuType(n, 1 << 33, f * speed * 1e12, f * speed * 1e12, speed * 1e15, 1.0)
           for n, f in (("a", 2.0), ("b", 1.0))]
  return make_cluster("conv", [[types[0]] * 2, [types[1]] * 2], *FAST_LINKS)


def first_time(metrics, target):
  return next((r["time"] for r in metrics if r.get("test_accuracy", 0) >= target), None)


@pytest.mark.slow
def test_the_evaluator_reports_test_accuracy_and_the_mean_loss_per_label():
  import jax

  from hetpipe_jax.evaluate import make_evaluator
  from hetpipe_jax.models.base import cross_entropy
  data = load_dataset("tokens")
  model = get_model("gpt", data.num_classes)
  params = model.init(jax.random.PRNGKey(0), data.x_train[:2])
  got = make_evaluator(model, data, jax.devices()[0], chunk=100)(params)  # 256 test sequences: 3 chunks
  logits = model.apply(params, data.x_test)
  assert got["test_accuracy"] == pytest.approx(float((np.argmax(logits, -1) == data.y_test).mean()))
  assert got["test_loss"] == pytest.approx(float(cross_entropy(logits, data.y_test)), rel=1e-5)


def test_data_parallel_with_one_gpu_is_plain_sgd():
  ref_losses, ref_params = plain_sgd(optax.sgd(0.1))
  rows = train_data_parallel(model=get_model("mlp"), dataset=TDATA, tx=optax.sgd(0.1), num_workers=1, batch_size=32,
                             steps=STEPS, step_seconds=0.5, seed=3, eval_every=STEPS).rows
  np.testing.assert_allclose([r.train_loss for r in rows], ref_losses, rtol=1e-5)
  assert rows[-1].time == pytest.approx(STEPS * 0.5) and rows[-1].test_accuracy is not None


@pytest.mark.slow
def test_short_runs_learn_and_repeat():
  data = load_dataset("digits")
  model = get_model("mlp")
  config = RunConfig.of(cluster=cluster(), num_vws=2, stages=2, nm=2, d=1, waves=60, batch_size=32,
                     learning_rate=0.1, eval_every=20)
  a, b = run_hetpipe(model, data, config), run_hetpipe(model, data, config)
  assert_trace_ok(a.events)
  assert a.metrics == b.metrics  # same seed, same curve
  assert a.metrics[-1]["test_accuracy"] > 0.7  # chance is 0.1
  ssp = run_hetpipe(model, data, config.replace(policy=[[0], [1], [2], [3]], nm=1, d=2,
                                                     waves=60))
  assert_trace_ok(ssp.events)
  assert ssp.metrics[-1]["test_accuracy"] > 0.7
  dp = train_data_parallel(model=model, dataset=data, tx=optax.sgd(0.1), num_workers=4, batch_size=32, steps=60,
                           step_seconds=1.0, eval_every=60).rows
  assert dp[-1].test_accuracy > 0.7


def test_doubling_every_gpu_halves_the_time_to_target():
  model, data = get_model("mlp"), synthetic(num_train=512, num_test=128)
  times = []
  for speed in (1.0, 2.0):
    result = run_hetpipe(model, data, RunConfig.of(cluster=cluster(speed), num_vws=2, stages=2, nm=2, d=1,
                                                waves=30, batch_size=16, learning_rate=0.1, eval_every=2))
    assert_trace_ok(result.events)
    times.append(first_time(result.metrics, 0.6))
  assert times[0] is not None and times[1] == pytest.approx(times[0] / 2, rel=1e-6)


def test_pilot_choices_take_the_estimates_best_and_faster_points_of_the_front():

  def result(name, nm, ips, staleness):
    plan = type("Plan", (), {"nm": nm, "in_flight": nm})()
    return type("Result", (), {"candidate": type("C", (), {"grouping": name, "plans": (plan,)})(),
                               "images_per_sec": ips, "staleness": staleness})()

  results = [result("A", 1, 100.0, 0.0), result("A", 2, 200.0, 2.0), result("A", 2, 210.0, 2.5),  # 2 settings
             result("B", 4, 300.0, 10.0), result("B", 8, 400.0, 40.0), result("C", 16, 500.0, 90.0),
             result("C", 1, 150.0, 50.0)]  # off the front: slower than A at Nm 2 and more stale
  key = lambda r: (r.candidate.grouping, r.candidate.plans[0].nm, r.images_per_sec)
  chosen, front = pilot_choices(results, None, 2)
  assert [key(r) for r in front] == [("A", 1, 100.0), ("A", 2, 210.0), ("B", 4, 300.0), ("B", 8, 400.0),
                                     ("C", 16, 500.0)]  # one per configuration: its fastest setting
  assert [key(r) for r in chosen] == [("A", 2, 210.0), ("B", 8, 400.0)]  # inside the front, evenly
  fit = StalenessModel(1000.0, 0.05)  # seconds: A1 10, A2 5.6, B4 5, B8 7.5, C16 11
  chosen, _ = pilot_choices(results, fit, 4)
  assert [key(r) for r in chosen] == [("B", 4, 300.0), ("A", 2, 210.0), ("B", 8, 400.0), ("C", 16, 500.0)]


def test_the_fewest_examples_pilot_is_the_sooner_of_a_tie_and_none_when_no_pilot_reached_the_target():
  pilot = lambda when, examples: TunedPilot("c", 1.0, 0.0, 0.0, None, when, examples, 0.9, 0)
  assert fewest_examples("abcd", [pilot(9.0, 500), pilot(None, None), pilot(4.0, 300), pilot(3.0, 300)]) == "d"
  assert fewest_examples("ab", [pilot(None, None), pilot(None, None)]) is None


@pytest.mark.slow
def test_convergence_cli(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run([sys.executable, "-m", "experiments.convergence", "--model=mlp", "--dataset=digits",
                         "--cluster=paper_mini", "--policies=ED", "--ds=0,4", "--epochs=2", "--lr_epochs=0.3",
                         "--systems=horovod,hetero_dp,local_sgd", "--lr_grid=0.5,1", "--outer_lr_grid=0.5,1,1.5",
                         "--eval_examples=200",
                         "--time_model=none", "--seeds=0,1", "--ssp", "--tuned_objective=measured",
                         "--target_accuracy=0.3", "--pilots=2", "--pilot_seed=7", f"--out_dir={tmp_path}",
                         "--noise_levels=none,jitter=0.05"],
                        capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads((tmp_path / "convergence.json").read_text())
  assert {"target_accuracy", "time_axis", "runs", "summary", "seeds", "table", "learning_rates"} <= set(doc)
  for seed in (0, 1):
    systems = [r["system"] for r in doc["runs"] if r["seed"] == seed]
    assert systems[:5] == ["horovod", "hetero_dp", "local_sgd", "hetpipe", "hetpipe"] and systems[-1] == "ssp"
    rows = [r["row"] for r in doc["runs"] if r["seed"] == seed]
    assert rows[5:7] == ["HetPipe tuned", "HetPipe tuned + outer"]
  assert doc["target_accuracy"] == 0.3 and doc["target_rule"] == "given"
  outer_systems = {"hetpipe_outer:delayed_nesterov", "hetpipe_outer:heloco"}  # the default --outer's two rules
  assert {p["system"] for p in doc["lr_pilots"]} == {"horovod", "hetero_dp", "local_sgd", "hetpipe", *outer_systems}
  assert {p["seed"] for p in doc["lr_pilots"]} == {7}
  # the same search for every system: 2 inner factors, then 2 pilots more (the outer grid 0.5,1.5 or refinements)
  choices = doc["lr_choices"]
  assert {c["system"]: c["pilots"] for c in choices.values()} == dict.fromkeys(choices, 4)
  assert all(len(p["curve"]) >= 1 or p["diverged"] for p in doc["lr_pilots"])
  outer = {p["outer_lr"] for p in doc["lr_pilots"] if p["system"] == "local_sgd"}
  assert outer == {0.35, 0.7, 1.05}  # DiLoCo's 0.7 (--outer_lr) x the outer grid
  assert all(r["outer_lr"] == choices["local_sgd"]["outer_lr"] for r in doc["runs"] if r["system"] == "local_sgd")
  # the outer row: the rule whose pilots ended best, at its chosen rate (a rule of a round weighs pushes itself),
  # its configuration measured again under it (--pilots runs with each rule)
  rule = doc["tuned"]["outer_rule"]
  finals = {s: max(p["final_smoothed"] or 0 for p in doc["lr_pilots"] if p["system"] == s) for s in outer_systems}
  assert finals[f"hetpipe_outer:{rule}"] == max(finals.values())
  chosen = choices[f"hetpipe_outer:{rule}"]["outer_lr"]
  rows = [r for r in doc["runs"] if r["row"] == "HetPipe tuned + outer"]
  assert rows and all(r["ps_optimizer"].startswith(f"{rule}:lr={chosen!r},") for r in rows)
  n = len(doc["tuned"]["pilots"]) // 2
  assert [p["rule"].split(":")[0] for p in doc["tuned"]["pilots"]] == ["add"] * n + [rule] * n
  for run in doc["runs"]:
    assert {"name", "row", "system", "seed", "d", "nm", "gpus", "lr", "time_to_target_s", "final_test_accuracy",
            "curve", "images_per_sec", "efficiency"} <= set(run)
    assert all(len(point) == 5 and point[4] > 0 for point in run["curve"])  # ..., train loss, test loss
    if run["system"] in ("hetpipe", "ssp"):  # the time axis follows the sim executor's rate for the configuration
      assert run["time_scale"] > 0 and run["mean_staleness"] >= 0
    else:
      assert run["global_batch"] >= 1 and run["round_seconds"] > 0
  assert [r["name"] for r in doc["table"]] == list(doc["summary"])
  assert "staleness_model" in doc or "staleness_note" in doc
  pilots = doc["tuned"]["pilots"]  # the tuned configuration: the pilot runs' fastest to the target, per rule
  assert doc["tuned"]["objective"] == "measured" and 2 <= len(pilots) <= 4
  assert {p["seed"] for p in pilots} == {7}
  for key, rule_of in (("label", lambda p: p["rule"] == "add"), ("outer_label", lambda p: p["rule"] != "add")):
    reached = [p for p in pilots if rule_of(p) and p["time_to_target_s"] is not None]
    assert not reached or doc["tuned"][key] == min(reached, key=lambda p: p["time_to_target_s"])["label"]
  assert (tmp_path / "convergence.png").stat().st_size > 10_000 and (tmp_path / "convergence.csv").exists()
  assert "time to target" in proc.stdout and "mean staleness" in proc.stdout
  # timed again under each noise level: none gives the table itself; jitter moves the times, not the examples
  quiet, noisy = doc["noise_levels"]["none"], doc["noise_levels"]["jitter=0.05"]
  assert [(r["name"], r["mean_time_to_target_s"]) for r in quiet] == [(r["name"], r["mean_time_to_target_s"])
                                                                       for r in doc["table"]]
  assert [r["mean_examples_to_target"] for r in noisy] == [r["mean_examples_to_target"] for r in doc["table"]]
  assert any(r["images_per_sec"] != q["images_per_sec"] for r, q in zip(noisy, quiet))
  assert "under noise jitter=0.05" in proc.stdout


def test_time_to_target_is_when_the_smoothed_curve_stays_above_it():
  curve = [[t, t, acc, 0.0, 1.0 - acc] for t, acc in enumerate([0.5, 0.9, 0.5, 0.8, 0.9, 0.9, 0.85])]
  assert Target("accuracy", 2).smoothed(curve)[:3] == pytest.approx([0.5, 0.7, 0.7])
  assert Target("accuracy", 2).reached_at(curve, 0.85) == 4  # 0.85, 0.9, 0.875 from there; 0.65 before
  assert Target("accuracy", 2).time_to(curve, 0.85) == 4
  assert Target("accuracy", 2).images_to(curve, 0.85, 32) == 4 * 32
  assert Target("accuracy", 1).reached_at(curve, 0.85) == 4  # raw: 0.9, 0.9, 0.85 from t=4 on
  assert Target("accuracy", 3).reached_at(curve, 0.95) is None
  # a loss target (the test loss 1 - accuracy here): at or below it, from the same evaluation
  assert Target("loss", 2).reached_at(curve, 0.15) == 4 and Target("loss", 2).better(0.2) == -0.2


def test_the_automatic_target_is_095_of_the_best_final_smoothed_accuracy():
  runs = [{"name": n, "curve": [[0, 0, a, 0.0, 1.0], [1, 1, b, 0.0, 1.0 - b]]} for n, a, b in
          (("x", 0.6, 0.8), ("x", 0.7, 0.9), ("y", 0.9, 0.9))]  # final smoothed: x 0.7, 0.8 (mean 0.75); y 0.9
  assert Target("accuracy", 2).of_runs(runs) == pytest.approx(0.95 * 0.9)
  # a loss: the best (lowest) final smoothed loss over 0.95 (x: 0.6 and 0.55, mean 0.575; y: 0.55)
  assert Target("loss", 2).of_runs(runs) == pytest.approx(0.55 / 0.95)


def test_the_table_reports_examples_to_target_beside_time_against_the_fewest_of_a_peer():
  """A peer at 90k and 120k examples (seeds 0, 1; mean 105k), HetPipe at 150k and 160k (155k: 1.48x the peer's), a
  HetPipe configuration that missed on one seed (no mean)."""
  def run(name, system, seed, examples):
    outcome = Outcome(None if examples is None else examples / 1000, examples, 0.8, 0.8, 0.5, 1.6)
    return ConvergenceRun(name, name, system, seed, 0, [1], 0.1, 4, 1000.0, 0.5, [], outcome=outcome)
  summary = {"peer": summarise([run("peer", "local_sgd", 0, 90e3), run("peer", "local_sgd", 1, 120e3)]),
             "hp": summarise([run("hp", "hetpipe", 0, 150e3), run("hp", "hetpipe", 1, 160e3)]),
             "missed": summarise([run("missed", "hetpipe", 0, 150e3), run("missed", "hetpipe", 1, None)])}
  rows = {r.name: r for r in table(summary)}
  assert summary["peer"].mean_examples_to_target == 105e3 and rows["peer"].examples_vs_best_peer == 1.0
  assert rows["hp"].mean_examples_to_target == 155e3 and rows["hp"].examples_vs_best_peer == pytest.approx(155 / 105)
  assert rows["missed"].mean_examples_to_target is None and rows["missed"].examples_vs_best_peer is None


def test_a_language_models_runs_report_perplexity_against_time(capsys):
  curve = [CurvePoint(1.5, 10, 0.2, 3.0, math.log(30.0)), CurvePoint(3.0, 20, 0.3, 2.5, math.log(12.0))]
  outcome = Outcome(None, None, 0.3, 0.25, math.log(12.0), 12.0)
  run = ConvergenceRun("HetPipe NP D=0", "HetPipe NP D=0", "hetpipe", 0, 0, [1], 0.1, 2, 10.0, 0.5, curve,
                       wsp=WspStats(1.0, "add", {}, 0.0), outcome=outcome, language=True)
  assert run.to_json()["perplexity_curve"] == [[1.5, pytest.approx(30.0)], [3.0, pytest.approx(12.0)]]  # exp(loss)
  assert "perplexity_curve" not in run._replace(language=False).to_json()
  result = types.SimpleNamespace(unigram=Unigram(math.log(27.8), 27.8), runs=[run],
                                 summary={run.name: summarise([run])})
  print_perplexity(result)  # type: ignore[arg-type]
  out = capsys.readouterr().out
  assert "the training set's unigram frequencies: 27.8, loss 3.3250" in out
  assert "HetPipe NP D=0: final 12 (mean over 1 seeds; loss 2.4849) at 3 s" in out
  print_perplexity(types.SimpleNamespace(unigram=None, runs=[], summary={}))  # type: ignore[arg-type]
  assert capsys.readouterr().out == ""  # an image model: no perplexity


def test_under_noise_every_run_is_timed_again_at_its_own_seeds_noise():
  """Two runs (seeds 0, 1) of a peer at 1,000 examples/s reaching 0.8 at 10 s (10k examples), and of HetPipe at
  500/s reaching it at 40 s: under a level whose clock gives the peer 500/s on seed 0 and 250/s on seed 1 and
  HetPipe 500/s on both, the peer's times double and quadruple (20 and 40 s, mean 30) and HetPipe's stay; the
  examples to target do not move."""
  def run(name, system, seed, rate, reach):
    curve = [CurvePoint(t * reach / 2, t * 5000 / 32, acc, 0.0, 1.0 - acc) for t, acc in ((1, 0.5), (2, 0.8))]
    return ConvergenceRun(name, name, system, seed, 0, [1], 0.1, 4, rate, rate / 2000, curve)
  runs = [run("peer", "local_sgd", s, 1000.0, 10.0) for s in (0, 1)] + [run("hp", "hetpipe", s, 500.0, 40.0)
                                                                         for s in (0, 1)]
  asked = []

  def clock(r, noise):
    asked.append((r.name, noise))
    return 500.0 if r.system == "hetpipe" or noise.endswith("seed=0") else 250.0
  tables = noise_tables(runs, ["default*2"], clock, Target("accuracy", 1), 0.8, 32, 2000.0)
  rows = {r.name: r for r in tables["default*2"]}
  assert rows["peer"].mean_time_to_target_s == pytest.approx(30.0) and rows["peer"].max_time_to_target_s == 40.0
  assert rows["hp"].mean_time_to_target_s == pytest.approx(40.0) and rows["hp"].speedup_vs_best_peer == 0.75
  assert rows["peer"].mean_examples_to_target == rows["hp"].mean_examples_to_target == 10000.0
  assert ("peer", "default*2,seed=1") in asked and seeded("none", 3) == "none"
