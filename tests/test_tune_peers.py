"""The tuner's peer search (hetpipe_jax.tune.peers) and the peers' images to target (hetpipe_jax.tune.statistical):
the grid, a peer winning where it is faster, both objectives, tune.json's best / best_hetpipe, and train --plan
running a peer's configuration on the sim executor."""

import json
import math
import os
import subprocess
import sys

import pytest
from test_peers import NET, PCIE, PROFILES, TWO_NODES, UNITS

from hetpipe_jax import ConfigError, get_cluster
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import GpuType, make_cluster
from hetpipe_jax.cost.batch import BatchProfiles, fixed
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.systems import WSP, systems
from hetpipe_jax.tune import (
  CriticalBatch,
  PeerAccuracyModel,
  PeerResult,
  Result,
  SearchSpace,
  TuneOptions,
  fit_critical_batch,
  fit_local_steps,
  fit_peer_accuracy,
  peer_grid,
  peer_json,
  peer_knobs,
  peer_result_json,
  search_peers,
  system_of,
  tune,
)
from hetpipe_jax.tune.peers import simulate_setting
from hetpipe_jax.tune.statistical import leave_one_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/test_peers.py's hand-worked model: two units of 1 + 2 Tflop at batch 32, 100 MB and 300 MB of weights
ALL = tuple(name for name, system in systems().items() if system.kind != WSP)  # the peers
SMALL = SearchSpace(ds=(0,), nm_max=2, peers=ALL)
QUICK = TuneOptions(waves=4, screen=2, refine=1, workers=1)


@pytest.fixture(scope="module")
def two_node_tune():
  return tune(TWO_NODES, PROFILES, 32, SMALL, QUICK)


def test_peer_grid_by_hand():
  grid = {name: peer_grid(name, TWO_NODES, 32) for name in ALL}
  assert [k.fusion_mb for k in grid["horovod"]] == [64.0, 0.0]
  assert [k.global_batch for k in grid["hetero_dp"]] == [32, 64, 128]  # 1/2, 1, 2 x 32 x 2 GPUs
  assert [(k.policy, k.microbatches) for k in grid["sync_pipeline"]] == [
      (p, m) for p in ("NP", "ED", "HD") for m in (2, 4, 8)]
  local = grid["local_sgd"]
  assert len(local) == 4 * 2 * 4  # H x by speed x (GPU workers, pipelines of NP, ED, HD)
  assert {k.local_steps for k in local} == {2, 4, 8, 16} and {k.h_by_speed for k in local} == {False, True}
  assert {(k.local_workers, k.policy) for k in local} == {("gpu", "best"), ("vw", "NP"), ("vw", "ED"), ("vw", "HD")}
  assert {k.outer_lr for k in local} == {PeerKnobs().outer_lr}  # no effect on time: the default, recorded
  assert [k.policy for k in peer_grid("sync_pipeline", TWO_NODES, 32, ("HD",))] == ["HD"] * 3
  with pytest.raises(ConfigError, match="unknown system"):
    peer_grid("gossip", TWO_NODES, 32)


def test_search_peers_skips_what_cannot_run_with_its_reason():
  # two GPUs of 1 GiB: no GPU holds the 400 MB model with its optimizer state and activations at batch 32
  tiny = GpuType("tiny", 1 << 30, 10e12, 10e12, 1e18, 1.0)
  big = [UnitProfile(f"u{i}", 1e12, 2e12, 1, 1, 400_000_000, 10_000_000, 0) for i in range(2)]
  cluster = make_cluster("tiny2", [[tiny], [tiny]], PCIE, NET)
  lines = []
  found, skipped = search_peers(("horovod",), cluster, fixed(big, 32), 32, progress=lines.append)
  assert not found and len(skipped) == 2 and all(s.system == "horovod" and s.reason for s in skipped)
  assert lines[0].startswith("peer horovod: 0 settings simulated, 2 cannot run")


def test_tuner_searches_the_peers_and_a_peer_wins_where_it_is_faster(two_node_tune):
  """On two GPUs of two speeds, hetero_dp's speed-proportional split beats every HetPipe configuration in
  images/s: the overall best is a peer, HetPipe's best stays in ``best``."""
  out = two_node_tune
  assert isinstance(out.best, Result) and out.best is out.results[0]
  assert {p.system for p in out.peers} == set(ALL)
  assert len(out.peers) + len(out.peers_skipped) == sum(len(peer_grid(s, TWO_NODES, 32)) for s in ALL)
  rates = [p.images_per_sec for p in out.peers]
  assert rates == sorted(rates, reverse=True)  # ranked by images/s
  best_peers = out.best_peers()
  assert list(best_peers) == list(dict.fromkeys(p.system for p in out.peers))
  assert best_peers["hetero_dp"].images_per_sec > out.best.images_per_sec
  assert isinstance(out.overall, PeerResult) and out.overall is out.peers[0]
  assert out.overall.images_per_sec == max(rates) and out.peer_accuracy is None
  hetero = [p for p in out.peers if p.system == "hetero_dp"]
  assert {p.examples_per_update for p in hetero} == {32, 64, 128} and all(p.staleness == 0 for p in hetero)
  assert all(0 < p.efficiency <= 1 for p in out.peers)
  # HetPipe alone (the default space) is what the tuner searched before: no peers
  alone = tune(TWO_NODES, PROFILES, 32, SearchSpace(ds=(0,), nm_max=2), QUICK)
  assert alone.peers == () and alone.overall is alone.best
  assert [(r.candidate, r.images_per_sec) for r in alone.results] == [
      (r.candidate, r.images_per_sec) for r in out.results]


def test_the_peer_search_needs_profiles_at_two_batch_sizes():
  with pytest.raises(ConfigError, match="BatchProfiles"):
    tune(TWO_NODES, UNITS, 32, SMALL, QUICK)


def test_time_to_accuracy_ranks_peers_by_their_images_to_target():
  """Synchronous peers need E(B) = 1000 x (1 + B / 32) images, local SGD never reaches the target: the peers
  rank by those images over their images/s, local SGD last, and HetPipe's staleness model ranks it."""
  staleness = StalenessModel(2000.0, 0.0, 0.8)
  accuracy = PeerAccuracyModel(sync=CriticalBatch(1000.0, 32.0), sync_missed=False, local_missed=True,
                               fallback_images=2000.0)
  out = tune(TWO_NODES, PROFILES, 32, SMALL, TuneOptions(waves=4, screen=2, refine=1, workers=1,
                                                         staleness_model=staleness, peer_accuracy=accuracy))
  seconds = [accuracy.seconds(p) for p in out.peers]
  assert seconds == sorted(seconds)
  assert all(math.isinf(s) for p, s in zip(out.peers, seconds) if p.system == "local_sgd")
  hetero = {p.examples_per_update: p for p in out.peers if p.system == "hetero_dp"}
  assert accuracy.images(hetero[32]) == pytest.approx(2000.0) and accuracy.images(hetero[128]) == 5000.0
  hetpipe_s = staleness.seconds(out.best.images_per_sec, out.best.staleness)
  best_peer_s = min(seconds)
  assert (out.overall is out.best) == (hetpipe_s <= best_peer_s)
  doc = peer_result_json(out.peers[-1], accuracy)
  assert doc["system"] == "local_sgd" and doc["images_to_target"] is None and doc["time_to_accuracy_s"] is None
  # without a peer model, the peers fall back to the staleness model's images0 at staleness 0
  plain = tune(TWO_NODES, PROFILES, 32, SMALL, TuneOptions(waves=4, screen=2, refine=1, workers=1,
                                                           staleness_model=staleness))
  assert plain.peer_accuracy is not None and plain.peer_accuracy.fallback_images == 2000.0
  assert any("images0" in line for line in plain.peer_accuracy.lines())
  assert [plain.peer_accuracy.seconds(p) for p in plain.peers] == [2000.0 / p.images_per_sec for p in plain.peers]


def test_critical_batch_fit_recovers_e_min_and_b_noise():
  truth = CriticalBatch(1000.0, 256.0)
  points = [(b, truth.images(b)) for b in (32, 64, 128, 256, 512, 1024)]
  fit = fit_critical_batch(points)
  assert fit.e_min == pytest.approx(1000.0) and fit.b_noise == pytest.approx(256.0)
  assert fit.images(2048) == pytest.approx(9000.0) and "E(B) = 1000 x (1 + B / 256)" in fit.how
  assert max(abs(e) for e in leave_one_out(points, fit_critical_batch)) < 1e-9  # exact points: exact held out
  noisy = [(b, e * (1 + 0.02 * (-1) ** i)) for i, (b, e) in enumerate(points)]
  fit = fit_critical_batch(noisy)
  assert fit.e_min == pytest.approx(1000.0, rel=0.1) and fit.b_noise == pytest.approx(256.0, rel=0.1)
  errors = leave_one_out(noisy, fit_critical_batch)
  assert len(errors) == len(noisy) and 0 < max(abs(e) for e in errors) < 0.1


def test_critical_batch_with_one_batch_size_or_no_growth_is_the_mean():
  one = fit_critical_batch([(512, 100.0), (512, 110.0), (512, 120.0)])
  assert one.images(32) == one.images(4096) == pytest.approx(110.0) and math.isinf(one.b_noise)
  assert one.how.startswith("runs at one global batch only (B = 512)")
  flat = fit_critical_batch([(64, 120.0), (512, 100.0)])
  assert flat.images(64) == pytest.approx(110.0) and "do not grow with B" in flat.how
  unknown = fit_critical_batch([(None, 100.0), (512, 120.0)])
  assert unknown.images(512) == pytest.approx(110.0) and "record no global batch" in unknown.how
  with pytest.raises(ConfigError):
    fit_critical_batch([])
  assert leave_one_out([(512, 100.0), (512, 120.0)], fit_critical_batch) == []  # too few to hold one out


def test_local_steps_fit_interpolates_in_h():
  fit = fit_local_steps([(2, 100.0), (8, 150.0), (8, 170.0)])
  assert fit.points == ((2.0, 100.0), (8.0, 160.0))
  assert [fit.images(h) for h in (1, 2, 5, 8, 16)] == pytest.approx([100.0, 100.0, 130.0, 160.0, 160.0])
  one = fit_local_steps([(8, 90.0), (8, 110.0)])
  assert one.images(2) == one.images(16) == pytest.approx(100.0) and "one H only (H = 8)" in one.how


def _peer(system: str, update: int, h: int = 1) -> PeerResult:
  return PeerResult(system, PeerKnobs(local_steps=h), 100.0, 200.0, 1.0, update, update, 2, h)


def test_peer_accuracy_from_convergence_runs_and_its_fallbacks():
  staleness = StalenessModel(5000.0, 0.2, 0.85)
  runs = [{"system": "horovod", "seed": s, "global_batch": 256, "images_to_target": 4000.0 + 100 * s}
          for s in range(3)]
  runs += [{"system": "hetero_dp", "seed": 0, "global_batch": 512, "images_to_target": None},
           {"system": "local_sgd", "seed": 0, "local_steps": [8, 4], "images_to_target": 6000.0},
           {"system": "local_sgd", "seed": 1, "local_steps": [2, 1], "images_to_target": 3000.0},
           {"system": "hetpipe", "seed": 0, "mean_staleness": 1.0, "images_to_target": 9999.0}]
  model = fit_peer_accuracy(runs, staleness)
  assert model.target_accuracy == 0.85
  assert model.images(_peer("sync_pipeline", 2048)) == pytest.approx(4100.0)  # one B: the mean, for every B
  assert model.images(_peer("local_sgd", 32, 4)) == pytest.approx(4000.0)  # between H = 2 and H = 8
  assert model.seconds(_peer("local_sgd", 32, 8)) == pytest.approx(60.0)
  lines = model.lines()
  assert any("one global batch only (B = 256)" in line and "1 of 4 runs missed" in line for line in lines)
  assert any("leave-one-out" in line and "3 runs" in line for line in lines)
  assert model.to_json()["sync"]["b_noise"] is None and json.dumps(model.to_json())
  # no runs at all: the staleness model's images0 (staleness 0), said so
  empty = fit_peer_accuracy([], staleness)
  assert empty.images(_peer("hetero_dp", 64)) == empty.images(_peer("local_sgd", 32, 8)) == 5000.0
  assert all("fall back to the staleness model's images0" in line for line in empty.lines())
  # runs of a kind that all missed: that kind does not reach the target
  missed = fit_peer_accuracy([{"system": "local_sgd", "images_to_target": None}], staleness)
  assert math.isinf(missed.images(_peer("local_sgd", 32, 8))) and missed.images(_peer("horovod", 64)) == 5000.0
  with pytest.raises(ConfigError, match="experiments.convergence"):
    fit_peer_accuracy([]).images(_peer("horovod", 64))


def test_peer_json_round_trip():
  peer = simulate_setting("local_sgd", TWO_NODES, PROFILES, 32, PeerKnobs(local_steps=4, h_by_speed=True))
  doc = peer_json(peer)
  assert doc["system"] == "local_sgd" and system_of(doc) == "local_sgd" and system_of({"grouping": "ED"}) == "hetpipe"
  assert {"fusion_mb", "global_batch", "microbatches", "policy", "local_steps", "h_by_speed", "local_workers",
          "images_per_sec", "efficiency"} <= set(doc)
  assert peer_knobs(doc) == peer.knobs and peer_knobs({"system": "horovod"}) == PeerKnobs()
  assert peer.local_steps == 4 and peer.examples_per_update == 32
  with pytest.raises(ConfigError, match="local_steps"):
    peer_knobs({"local_steps": 0})


def _run(*args, timeout=300):
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.slow  # (15-18 s: the README's command keeps under 10 minutes; .ci/run runs it)
def test_tune_cli_falls_back_to_throughput_and_writes_best_and_best_hetpipe(tmp_path):
  """Without the convergence study's file the default objective ranks by images/s, said in one line;
  ``best`` names its system, ``best_hetpipe`` is the best WSP configuration in the form ``best`` had, and
  a tune.json from before (no ``system``, no ``best_hetpipe``) still runs."""
  out = tmp_path / "tune"
  missing = tmp_path / "none" / "convergence.json"
  proc = _run("experiments.tune", "--model=mlp", "--dataset=digits", "--cluster=hetero4", "--waves=2", "--nm_max=1",
              "--ds=0", "--transfers=serial", "--ps_transfers=whole", "--peers=hetero_dp,horovod",
              f"--staleness_model={missing}", f"--out_dir={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  fallback = [line for line in proc.stdout.splitlines() if line.startswith("objective:")]
  assert len(fallback) == 1 and str(missing) in fallback[0] and "which is missing" in fallback[0]
  assert "python -m experiments.convergence" in fallback[0] and "images/s (throughput)" in fallback[0]
  assert "peers, the best setting of each" in proc.stdout and "hetero_dp, global batch" in proc.stdout
  doc = json.loads((out / "tune.json").read_text())
  assert doc["objective"] == "throughput" and doc["objective_note"] == fallback[0]
  best, hetpipe = doc["best"], doc["best_hetpipe"]
  assert hetpipe["system"] == "hetpipe" and {"model", "cluster", "batch_size", "policy", "cuts", "nm", "d",
                                             "placement", "images_per_sec", "efficiency"} <= set(hetpipe)
  assert hetpipe["images_per_sec"] == max(r["images_per_sec"] for r in doc["results"] if r["waves"] == 2)
  assert set(doc["peers_best"]) == {"hetero_dp", "horovod"} and len(doc["peers"]) == 5
  top = max([hetpipe] + doc["peers"], key=lambda r: r["images_per_sec"])
  assert best["system"] == top["system"] and best["images_per_sec"] == top["images_per_sec"]
  assert (out / "tune_peers.csv").exists() and (out / "tune.png").exists()
  # train --plan_entry=best_hetpipe runs the WSP configuration on sim; a plan from before does too
  proc = _run("experiments.train", f"--plan={out / 'tune.json'}", "--plan_entry=best_hetpipe", "--executor=sim",
              f"--out_dir={tmp_path / 'sim'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
  assert summary["images_per_second"] == pytest.approx(hetpipe["images_per_sec"], rel=0.02)
  assert summary["plan"]["entry"] == "best_hetpipe"
  old = {k: v for k, v in doc.items() if k not in ("best_hetpipe", "peers", "peers_best", "peers_skipped")}
  old["best"] = {k: v for k, v in hetpipe.items() if k != "system"}
  (tmp_path / "old.json").write_text(json.dumps(old))
  for entry in ("best", "best_hetpipe"):
    proc = _run("experiments.train", f"--plan={tmp_path / 'old.json'}", f"--plan_entry={entry}", "--executor=sim",
                f"--out_dir={tmp_path / 'old'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tuned plan" in proc.stdout and "trace check: OK" in proc.stdout


@pytest.fixture()
def peer_plan(tmp_path):
  """A tune.json whose best is hetero_dp's setting on the paper testbed (ResNet-152, global batch 256)."""
  peer = simulate_setting("hetero_dp", get_cluster("paper_testbed"), BatchProfiles.full_size("resnet152", 32), 32,
                          PeerKnobs(global_batch=256))
  setting = {"model": "resnet152", "dataset": None, "cluster": "paper_testbed", "batch_size": 32,
             "optimizer": "momentum", "weight_mode": "stash", "schedule": "1f1b", "waves": 50}
  path = tmp_path / "tune.json"
  path.write_text(json.dumps({**setting, "best": {**setting, **peer_result_json(peer)}}))
  return path, peer


@pytest.mark.slow
def test_train_plan_runs_a_peer_on_sim_and_refuses_it_elsewhere(peer_plan, tmp_path):
  path, peer = peer_plan
  proc = _run("experiments.train", f"--plan={path}", "--executor=sim", f"--out_dir={tmp_path / 'sim'}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("images_per_sec=") and "efficiency=" in last
  assert float(last.split()[0].split("=")[1]) == pytest.approx(peer.images_per_sec, rel=1e-5)
  assert float(last.split()[1].split("=")[1]) == pytest.approx(peer.efficiency, abs=1e-4)
  timeline = json.loads((tmp_path / "sim" / "hetero_dp.timeline.json").read_text())
  assert timeline["meta"]["images_per_sec"] == pytest.approx(peer.images_per_sec)
  summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
  assert summary["system"] == "hetero_dp" and summary["knobs"]["global_batch"] == 256
  proc = _run("experiments.train", f"--plan={path}", "--executor=virtual", f"--out_dir={tmp_path / 'v'}")
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-1] == (f"error: --plan={path}: a peer plan (system hetero_dp) runs on the sim executor; train its "
                       "numerics with experiments.convergence") and "Traceback" not in proc.stderr
  proc = _run("experiments.train", f"--plan={path}", "--executor=sim", "--batch_size=16")
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: --batch_size=16 disagrees")
  proc = _run("experiments.train", f"--plan={path}", "--plan_entry=best_hetpipe", "--executor=sim")
  assert proc.returncode == 1 and "has no 'best_hetpipe' configuration" in proc.stderr.strip().splitlines()[-1]
