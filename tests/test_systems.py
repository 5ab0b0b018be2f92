"""The System interface (:mod:`hetpipe_jax.systems`): the registry, and a toy system defined and registered in
this file only (:func:`register_toy`) that runs through ``experiments.baseline``, the tuner, the throughput study
and the convergence study without any other file knowing it (the scripts take it with
``--systems_module=tests.test_systems:register_toy``)."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax import ConfigError, get_cluster, get_model, synthetic
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker
from hetpipe_jax.cluster import make_cluster
from hetpipe_jax.cluster.catalogue import CATALOGUE, LINKS
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.plan.allocation import horovod_gpus
from hetpipe_jax.systems import (
  LOCAL,
  SYNCHRONOUS,
  Peer,
  SystemRun,
  TrainSetting,
  get_system,
  register,
  simulate_systems,
  systems,
  unregister,
)
from hetpipe_jax.tune import PeerResult, fit_peer_accuracy, search_peers
from hetpipe_jax.tune.statistical import LocalStepsFit

ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
PLUGIN = "--systems_module=tests.test_systems:register_toy"
BUILT_IN = ["horovod", "hetero_dp", "sync_pipeline", "local_sgd", "ps_sync", "ps_replicated", "tf_replicated",
            "gpipe", "tf_replicated_copy", "hetpipe"]


def solo_job(cluster, profiles, batch_size, knobs, costs) -> SyncJob:
  """The toy's timing: the first GPU that holds the model trains alone, ``knobs.global_batch`` (0: the batch size)
  examples a step."""
  gpus = horovod_gpus(cluster, profiles.at(batch_size), costs)
  if not gpus:
    raise ConfigError("solo: no GPU holds the model")
  batch = knobs.global_batch or batch_size
  return SyncJob("solo", cluster, (Worker((gpus[0],), (0, len(profiles.low)), batch),), profiles,
                 precision=costs.precision, rounds=knobs.sim_rounds, knobs=(("batch_size", batch), ("gpus", 1)))


class Solo(Peer):
  """A toy peer: one GPU, synchronous SGD (its numerics: the peers' trainer with one worker)."""

  name = "solo"
  summary = "the first GPU that holds the model, alone (a test's toy)"
  build = solo_job

  def grid(self, cluster, batch_size, policies):
    return [PeerKnobs(global_batch=batch_size), PeerKnobs(global_batch=2 * batch_size)]

  def config(self, run: SystemRun) -> str:
    return f"one GPU, batch {run.batch_sizes[0]}"


def register_toy() -> None:
  """What ``--systems_module=tests.test_systems:register_toy`` calls."""
  register(Solo(), replace=True)


@pytest.fixture
def toy():
  register_toy()
  yield get_system("solo")
  unregister("solo")


def run_script(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                        env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_the_registry_holds_every_system_and_refuses_an_unknown_one_in_one_line():
  assert list(systems())[:len(BUILT_IN)] == BUILT_IN
  assert {get_system(n).kind for n in BUILT_IN} == {SYNCHRONOUS, LOCAL, "wsp"}
  with pytest.raises(ConfigError) as e:
    get_system("nope")
  assert "unknown system 'nope'; choose one of horovod, hetero_dp" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="registered already"):
    register(Solo()) if "solo" in systems() else (register(Solo()), register(Solo()))
  unregister("solo")
  with pytest.raises(ConfigError, match="has no function 'nothing'"):
    from hetpipe_jax.systems import import_systems
    import_systems("tests.test_systems:nothing")


PROFILES = BatchProfiles.full_size("vgg19", 32)
MINI = get_cluster("paper_mini")


def test_the_toy_simulates_trains_and_tunes_through_the_library(toy):
  run = toy.simulate(MINI, PROFILES, 32, PeerKnobs(global_batch=48), CostContext())
  assert run.batch_sizes == (48,) and run.local_steps == (1,) and run.gpus == 1
  assert run.images_per_sec == pytest.approx(48 / run.round_seconds)
  assert toy.update_examples(run) == 48 and toy.label(PeerKnobs(), 48) == "solo, global batch 48"
  # the tuner: its grid, its label, its kind in the statistical model (a synchronous system: by global batch)
  results, skipped = search_peers(["solo", "local_sgd"], MINI, PROFILES, 32)
  mine = [r for r in results if r.system == "solo"]
  assert [r.examples_per_update for r in mine] == [32, 64] and not [s for s in skipped if s.system == "solo"]
  assert mine[1].label == "solo, global batch 64"
  runs = [{"system": "solo", "images_to_target": 1000.0 * (1 + b / 64), "global_batch": b} for b in (32, 64, 128)]
  runs.append({"system": "local_sgd", "images_to_target": 5000.0, "local_steps": [8]})
  model = fit_peer_accuracy(runs)
  assert model.sync is not None and model.sync.images(64) == pytest.approx(2000.0)
  assert isinstance(model.local, LocalStepsFit) and model.images(mine[0]) == pytest.approx(1500.0)
  # the studies' way: simulated by name, then trained with its numerics on its round's clock
  spec, = simulate_systems(["solo"], MINI, BatchProfiles.full_size("vgg19", 32), 32, CostContext(), PeerKnobs())
  data = synthetic(num_train=256, num_test=64)
  curve = toy.train(get_model("mlp"), data, spec.simulated, TrainSetting(0, 0.05, "sgd", 1.0, 64, 32))
  assert [p.time for p in curve] == pytest.approx([2 * spec.simulated.round_seconds * k for k in range(1, 5)])
  assert [p.minibatches for p in curve] == [2, 4, 6, 8] and all(0 <= p.test_accuracy <= 1 for p in curve)


def test_a_peer_result_is_labelled_by_its_system(toy):
  assert PeerResult("solo", PeerKnobs(), 1.0, 2.0, 1.0, 32, 32, 1).label == "solo, global batch 32"
  assert PeerResult("ps_sync", PeerKnobs(), 1.0, 2.0, 1.0, 32, 128, 4).label == "ps_sync, global batch 128"


def test_the_toy_through_the_baseline_cli(tmp_path, toy):
  proc = run_script("experiments.baseline", PLUGIN, "--system=solo", "--model=vgg19", "--cluster=paper_mini",
                    "--global_batch=48", f"--out_dir={tmp_path}")
  run = toy.simulate(MINI, PROFILES, 32, PeerKnobs(global_batch=48), CostContext(optimizer_slots=1))
  assert proc.stdout.splitlines()[-1] == f"images_per_sec={run.images_per_sec:.6g} efficiency={run.efficiency:.4f}"
  assert (tmp_path / "solo_vgg19_paper_mini.timeline.json").exists()
  listed = run_script("experiments.baseline", PLUGIN, "--system=list").stdout
  assert "solo               the first GPU that holds the model, alone (a test's toy)" in listed


def test_the_toy_through_the_throughput_study(tmp_path):
  out = tmp_path / "out"
  run_script("experiments.throughput", PLUGIN, "--systems=solo,horovod", "--cluster=paper_mini", "--models=mlp",
             "--waves=4", "--ds=0", "--sub_studies=", "--notuned", "--convergence=", f"--out_dir={out}")
  table = json.loads((out / "throughput.json").read_text())["models"]["mlp"]["table"]
  solo = table[0]
  assert [e["row"] for e in table[:2]] == ["solo", "horovod"] and solo["system"] == "solo"
  assert solo["config"] == "one GPU, batch 32" and solo["gpus"] == 1 and solo["images_per_sec"] > 0
  assert solo["signature"] == [[32], [1]] and solo["ratio_to_best_peer"] <= 1.0  # a peer: horovod is the best


@pytest.mark.slow  # about a minute here: HetPipe's run beside it, learning-rate pilots, two seeds
def test_the_toy_through_the_convergence_study(tmp_path):
  run_script("experiments.convergence", PLUGIN, "--systems=solo", "--cluster=paper_mini", "--policies=ED",
             "--notuned", "--outer=", "--seeds=0,1", "--lr_grid=1,2", "--epochs=0.05", "--lr_epochs=0.02",
             "--eval_examples=600", f"--out_dir={tmp_path}", timeout=600)
  doc = json.loads((tmp_path / "convergence.json").read_text())
  runs = [r for r in doc["runs"] if r["system"] == "solo"]
  assert [r["seed"] for r in runs] == [0, 1] and runs[0]["batch_sizes"] == [32] and runs[0]["global_batch"] == 32
  assert {p["system"] for p in doc["lr_pilots"]} == {"solo", "hetpipe"} and "solo" in doc["learning_rates"]
  assert [r["system"] for r in doc["table"]] == ["solo", "hetpipe"]
  assert doc["table"][0]["images_per_sec_vs_best_peer"] == 1  # the toy is a peer, the only one
  assert all(len(p) == 5 for p in runs[0]["curve"]) and runs[0]["curve"] != runs[1]["curve"]


@pytest.mark.slow  # 10-16 s: the fast suite keeps under 10 minutes
def test_the_tuner_refuses_a_one_node_cluster_where_nothing_fits_in_one_line(tmp_path):
  """(It ended in "ValueError: max() arg is an empty sequence": a one-node cluster has no HD pairs.)"""
  toml = tmp_path / "tiny.toml"
  toml.write_text('name = "tiny"\n[links]\nintra_node = "pcie3"\ninter_node = "ib_fdr56"\n[[nodes]]\n'
                  'gpus = ["RTX 2060"]\n')
  proc = subprocess.run([sys.executable, "-m", "experiments.tune", "--model=vgg19", f"--cluster={toml}",
                         "--batch_size=256", "--objective=throughput", f"--out_dir={tmp_path}"],
                        capture_output=True, text=True, timeout=300, env=ENV)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: no grouping of cluster 'tiny' fits the model")


def test_one_node_groupings_have_no_hd_pairs():
  from hetpipe_jax.tune import groupings
  one = make_cluster("one", [[CATALOGUE["TITAN V"], CATALOGUE["TITAN V"]]], LINKS["pcie3"], LINKS["ib_fdr56"])
  names = [name for name, _ in groupings(one)]
  assert "NP" in names and not any(name.startswith("HD pairs") for name in names)
