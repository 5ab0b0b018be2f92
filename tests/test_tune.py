"""The auto-tuner (issue 11): groupings, Nm choices, the WSP-aware modelled rate, the search, tuned plans run
by ``experiments.train --plan``, and the staleness-aware estimate of time to accuracy."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, load_dataset, run_hetpipe
from hetpipe_jax.core.check import check_trace
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.plan.partition import search_states
from hetpipe_jax.plan.vw_plan import StagePlan, VWPlan
from hetpipe_jax.sim import SimOptions
from hetpipe_jax.staleness import StalenessModel, fit_staleness_model, mean_staleness
from hetpipe_jax.tune import (
  Candidate,
  SearchSpace,
  TuneOptions,
  TuneResult,
  candidate_json,
  distinct_rows,
  groupings,
  modelled_images_per_sec,
  nm_choices,
  pareto_front,
  policy_rows,
  spread,
  tune,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mlp_profiles():
  import jax
  import jax.numpy as jnp
  data = load_dataset("digits")
  return profile_units(get_model("mlp", data.num_classes), jax.ShapeDtypeStruct((32, 8, 8, 1), jnp.float32))


def test_search_states():
  cluster = get_cluster("paper_testbed")
  assert search_states(cluster.gpus[:4]) == 5  # four alike GPUs of one node: counts 0..4 of 1 signature
  assert search_states([cluster.gpus[i] for i in (0, 4, 8, 12)]) == 2**4 * 4  # four types
  assert search_states(cluster.gpus) == 5**4 * 4  # 16 GPUs: 16! / (4!)^4 = 63,063,000 orders


def test_groupings_cover_every_gpu_once():
  cluster = get_cluster("paper_testbed")
  found = dict(groupings(cluster))
  assert {"NP", "ED", "HD", "ED x2", "NP /2", "NP /4", "HD pairs /1", "HD pairs /4"} <= set(found)
  for name, groups in found.items():
    indices = sorted(g.index for group in groups for g in group)
    assert indices == list(range(16)), name
  assert all(len({g.type.name for g in group}) == 4 for group in found["ED x2"])
  assert all(len(group) == 1 for group in found["NP /4"])


def _plan(nm: int, seconds: float) -> VWPlan:
  return VWPlan(nm, (StagePlan(get_cluster("hetero4").gpus[0], 0, 1, seconds, 0),))


def test_modelled_rate_holds_every_virtual_worker_to_the_slowest_wave_rate():
  # VW 0: 2 minibatches/s, Nm 2 -> 1 wave/s; VW 1: 4 minibatches/s, Nm 1 -> 4 waves/s. Under WSP both run
  # 1 wave/s: 2 + 1 minibatches of 32 images per second.
  assert modelled_images_per_sec([_plan(2, 0.5), _plan(1, 0.25)], 32) == pytest.approx(96.0)
  assert modelled_images_per_sec([_plan(2, 0.5), _plan(4, 0.25)], 32) == pytest.approx(32 * 6)


def test_speed_sized_nm_gives_the_faster_virtual_worker_more_minibatches_per_wave():
  fast = {n: _plan(n, 0.25) for n in range(1, 9)}  # 4 minibatches/s at any Nm
  slow = {n: _plan(n, 1.0) for n in range(1, 9)}  # 1 minibatch/s
  choices = {tuple(p.nm for p in plans): rule for rule, plans in nm_choices([fast, slow], [1, 1])}
  assert choices[(1, 1)] == "max_fit"
  assert choices[(8, 2)] == "speed-sized"  # waves of 2 s each
  assert (4, 1) in choices and (2, 2) in choices  # speed-sized and uniform
  assert all(rule != "speed-sized" or nms[0] >= nms[1] for nms, rule in choices.items())


def test_candidate_json_keeps_the_plan_files_keys():
  """A candidate's simulator options are one SimOptions; tune.json keeps the flat keys train --plan reads."""
  c = Candidate("NP", "uniform", (_plan(2, 0.5),), d=1, placement="local", sim=SimOptions(overlap_transfers=True))
  doc = candidate_json(c)
  assert list(doc) == ["grouping", "nm_rule", "policy", "cuts", "nm", "window", "d", "placement",
                       "overlap_transfers", "staged_ps"]
  assert doc["overlap_transfers"] is True and doc["staged_ps"] is False
  assert doc["nm"] == [2] and doc["window"] == [2] and doc["d"] == 1
  assert c.label.endswith("local placement, overlapped transfers")
  assert c.job(get_cluster("hetero4"), [], 3).options == c.sim


def test_tuner_finds_the_fastest_checked_configuration(mlp_profiles):
  cluster = get_cluster("hetero4")
  lines = []
  space = SearchSpace(ds=(0, 2), nm_max=4)
  out = tune(cluster, mlp_profiles, 32, space, TuneOptions(waves=6, screen=6, refine=3, progress=lines.append,
                                                           workers=2))
  assert isinstance(out, TuneResult) and out.planned > 0 and out.partitions > 0 and out.seconds > 0
  results = out.results
  assert out.best is results[0]
  refined = [r for r in results if r.waves == 6]
  assert out.best.images_per_sec == max(r.images_per_sec for r in refined)
  assert {r.candidate.d for r in refined} == {0, 2}
  assert {r.candidate.sim.overlap_transfers for r in results} == {False, True}
  assert {r.candidate.sim.staged_ps for r in results} == {False, True}
  assert 0 < out.best.efficiency <= 1
  assert {"NP", "ED", "HD"} <= set(policy_rows(results))
  assert any(line.startswith("planned NP") for line in lines) and any("refined" in line for line in lines)
  # simulated in this process alone, the same results in the same order
  alone = tune(cluster, mlp_profiles, 32, space, TuneOptions(waves=6, screen=6, refine=3, workers=1))
  assert [(r.candidate, r.images_per_sec) for r in alone.results] == [
      (r.candidate, r.images_per_sec) for r in results]
  # the printed table: distinct rows; configurations that differ only in D and ran the same (a gate that never
  # closed) share one: a copy of the best at another D merges into its row, one with other numbers does not
  best = results[0]
  same = dataclasses.replace(best, candidate=dataclasses.replace(best.candidate, d=best.candidate.d + 7))
  other = dataclasses.replace(same, images_per_sec=best.images_per_sec / 2)
  rows = distinct_rows([best, *results[1:4], other, same, *results[4:]], 5)
  assert len(rows) == 5 and rows[0].results == (best, same)
  assert rows[0].label == best.candidate.label.replace(f"D={best.candidate.d},", f"D={best.candidate.d}/"
                                                       f"{best.candidate.d + 7},")
  assert [row.results for row in rows[1:]] == [(r,) for r in results[1:4]] + [(other,)]
  assert len({(row.first.images_per_sec, row.first.staleness, row.label) for row in rows}) == 5


def test_front_screening_adds_every_groupings_smaller_waves(mlp_profiles):
  """With front=n the screen also takes n of every grouping's Nm choices spread over its range, so the
  results hold less stale (smaller-wave) configurations than the fastest ones; the front of images/s
  against staleness is then monotone both ways."""
  cluster = get_cluster("hetero4")
  space = SearchSpace(ds=(0,), nm_max=4)
  options = lambda front: TuneOptions(waves=6, screen=2, refine=1, front=front, workers=1)
  plain, wide = (tune(cluster, mlp_profiles, 32, space, options(0)).results,
                 tune(cluster, mlp_profiles, 32, space, options(4)).results)
  nms = lambda results: {(r.candidate.grouping, tuple(p.nm for p in r.candidate.plans)) for r in results}
  assert nms(plain) < nms(wide)
  assert min(r.staleness for r in wide) < min(r.staleness for r in plain)
  front = pareto_front(wide)
  assert front[0].staleness == min(r.staleness for r in wide)
  assert front[-1].images_per_sec == max(r.images_per_sec for r in wide)
  for a, b in zip(front, front[1:]):
    assert a.staleness < b.staleness and a.images_per_sec < b.images_per_sec
  for r in wide:  # nothing off the front is both faster and less stale than a point on it
    assert not any(r.staleness < f.staleness and r.images_per_sec > f.images_per_sec for f in front)


def test_spread_by_hand():
  assert spread(list(range(10)), 4) == [0, 3, 6, 9]
  assert spread([1, 2], 5) == [1, 2]
  assert spread(list(range(10)), 1) == [0]


def test_tuner_refuses_too_few_waves(mlp_profiles):
  with pytest.raises(ConfigError, match="waves=1"):
    tune(get_cluster("hetero4"), mlp_profiles, 32, options=TuneOptions(waves=1))


def test_staleness_model_fit_by_hand():
  fit = fit_staleness_model([(0.0, 100.0), (2.0, 120.0), (4.0, 140.0)], 0.8)
  assert fit.images0 == pytest.approx(100.0) and fit.beta == pytest.approx(0.1)
  assert fit.seconds(images_per_sec=50.0, staleness=10.0) == pytest.approx(4.0)
  assert fit_staleness_model([(3.0, 90.0)]).beta == 0.0
  with pytest.raises(ConfigError, match="reached the target"):
    fit_staleness_model([])
  with pytest.raises(ConfigError, match="zero staleness"):
    fit_staleness_model([(1.0, 10.0), (2.0, 100.0)])
  assert StalenessModel(10.0, 0.5).images(2.0) == pytest.approx(20.0)
  # points that fall with staleness (noise) give beta = 0 and their mean, not a staleness that saves images
  falling = fit_staleness_model([(6.0, 500.0), (6.0, 480.0), (9.0, 400.0)])
  assert falling.beta == 0.0 and falling.images0 == pytest.approx(460.0)


def test_mean_staleness_counts_every_virtual_workers_missing_updates_by_hand():
  meta = {"ev": "meta", "num_vws": 2, "nm": [2, 1], "d": 1}
  events = [meta,
            {"ev": "fwd", "vw": 1, "stage": 0, "mb": 3, "t0": 0.5, "t1": 0.6, "own": 2, "glob": [0, 0]},
            {"ev": "complete", "vw": 1, "mb": 1, "t": 1.0},
            {"ev": "complete", "vw": 1, "mb": 2, "t": 2.0},
            # VW 0's minibatch 3 starts at 2.5: it misses its own minibatch 2 (own = 1) and one of VW 1's two
            # completed minibatches (glob[1] = 1 wave of Nm 1)
            {"ev": "fwd", "vw": 0, "stage": 0, "mb": 3, "t0": 2.5, "t1": 3.0, "own": 1, "glob": [0, 1]}]
  assert mean_staleness(events) == pytest.approx((0 + 2) / 2)
  # a virtual worker that left no longer counts
  assert mean_staleness(events[:4] + [{"ev": "leave", "vw": 1, "t": 2.2}] + events[4:]) == pytest.approx(0.5)


def test_grouping_with_cuts_is_an_explicit_layout():
  data = load_dataset("digits")
  model = get_model("mlp", data.num_classes)
  config = RunConfig.of(cluster="hetero4", policy=[[2, 0], [5]], cuts=[[0, 1, 4], [0, 4]], nm=[3, 1], d=1,
                     waves=4, executor="sim")
  result = run_hetpipe(model, data, config)
  meta = result.events[0]
  assert meta["gpus"][0] == [get_cluster("hetero4").gpus[i].name for i in (2, 0)]
  assert meta["cuts"] == [[0, 1, 4], [0, 4]] and meta["nm"] == [3, 1]
  assert check_trace(result.events) == []
  with pytest.raises(ConfigError, match="cuts .* of virtual worker 1"):
    run_hetpipe(model, data, RunConfig.of(cluster="hetero4", policy=[[2, 0], [5]], cuts=[[0, 1, 4], [0, 2]],
                                       nm=1, executor="sim"))
  with pytest.raises(ConfigError, match="overlap_transfers is a model of the sim executor"):
    run_hetpipe(model, data, RunConfig.of(cluster="hetero4", overlap_transfers=True))
  with pytest.raises(ConfigError, match="staged_ps is a model of the sim executor"):
    run_hetpipe(model, data, RunConfig.of(cluster="hetero4", staged_ps=True))


def _run(args, tmp_path, timeout=300):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.slow  # 20-30 s of subprocesses (.ci/run runs it; the README's test command keeps under 10 minutes)
def test_tune_cli_and_train_plan(tmp_path):
  """A tuned plan, tuned under a noise it records: the tuner writes it, train --plan runs it on sim under that noise
  (reproducing the prediction) and on the virtual executor (with numerics, the trace checked; the noise is the sim
  executor's, said in a note), and refuses a flag that disagrees in one line."""
  out = tmp_path / "tune"
  proc = _run(["experiments.tune", "--model=mlp", "--dataset=digits", "--cluster=hetero4", "--waves=6",
               "--nm_max=3", "--ds=0,1", f"--staleness_model={tmp_path / 'missing.json'}", f"--out_dir={out}",
               "--noise=jitter=0.05,seed=4"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "best:" in proc.stdout and (out / "tune.png").exists() and (out / "tune.csv").exists()
  doc = json.loads((out / "tune.json").read_text())
  best = doc["best_hetpipe"]  # the best WSP configuration (``best`` may be a peer's)
  assert doc["noise"] == best["noise"] == "jitter=0.05,seed=4"
  assert {"model", "cluster", "batch_size", "policy", "cuts", "nm", "d", "placement", "images_per_sec",
          "efficiency"} <= set(best)
  assert best["images_per_sec"] == max(r["images_per_sec"] for r in doc["results"] if r["waves"] == 6)
  plan = f"--plan={out / 'tune.json'}"
  proc = _run(["experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=sim", "--adapt=off",
               f"--out_dir={tmp_path / 'sim'}"], tmp_path)  # (the tuner predicts without re-planning)
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
  assert summary["images_per_second"] == pytest.approx(best["images_per_sec"], rel=0.02)
  assert summary["nm"] == best["nm"] and summary["window"] == best["window"] and summary["d"] == best["d"]
  proc = _run(["experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=virtual", "--waves=3",
               f"--out_dir={tmp_path / 'virtual'}"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "trace check: OK" in proc.stdout and "note: the plan's noise is a model of the sim executor" in proc.stdout
  other = 1 - best["d"] if best["d"] <= 1 else 0
  proc = _run(["experiments.train", plan, "--plan_entry=best_hetpipe", "--executor=sim", f"--d={other}"], tmp_path)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --d={other} disagrees with --plan=")


@pytest.mark.parametrize("args,start", [
    (["--transfers=sometimes"], "error: --transfers=sometimes; give serial, overlap or both"),
    (["--ps_transfers=whole,halves"], "error: --ps_transfers=whole,halves; give whole, staged or both"),
    (["--objective=time_to_accuracy", "--staleness_model=/nonexistent/convergence.json"],
     "error: --staleness_model=/nonexistent/convergence.json: cannot read it"),
    (["--peers=hetero_dp,gossip"], "error: --peers=hetero_dp,gossip: unknown system 'gossip'"),
    (["--top=-5"], "error: --top=-5; give how many configurations to print, >= 1"),
    (["--top=0"], "error: --top=0; give how many configurations to print, >= 1"),
    (["--tp=per_type"], "error: tp=per_type: the tuner searches one degree for every stage of a configuration"),
])
def test_tune_bad_input_is_one_line(args, start, tmp_path):
  proc = _run(["experiments.tune", *args, f"--out_dir={tmp_path}"], tmp_path, timeout=120)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith(start) and "Traceback" not in proc.stderr
