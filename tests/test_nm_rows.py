"""HetPipe's Nm rule where the planner's max_fit was fixed: ``experiments.baseline --system=hetpipe --nm_rule``
(the knob ``PeerKnobs.nm_rule``) and the throughput study's ``--nms`` rows, their goodput marks, and a bad rule
refused in one line."""

import os
import subprocess
import sys

import pytest
from test_nm_speed import TWO_NODES, units

from experiments.common import batch_profiles
from hetpipe_jax import ConfigError, get_cluster, get_model, synthetic
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cost.batch import fixed
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.studies.throughput import run_throughput
from hetpipe_jax.studies.throughput_records import ThroughputConfig
from hetpipe_jax.systems import TrainSetting, get_system
from hetpipe_jax.systems.hetpipe import Trainer

ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
POLICY_ROWS = ["HetPipe NP D=0", "HetPipe ED D=0", "HetPipe HD D=0"]


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, env=ENV)


def test_hetpipe_simulates_the_speed_rules_plan_by_hand():
  """FAST is twice SLOW (test_nm_speed): max_fit runs one minibatch each a wave, speed two on FAST (one in
  flight) and one on SLOW, so that both waves last 0.6 s; the trace runs that layout, and it is faster."""
  hetpipe, profiles = get_system("hetpipe"), fixed(units(2), 32)
  runs = {rule: hetpipe.simulate(TWO_NODES, profiles, 32, PeerKnobs(policy="NP", nm_rule=rule))
          for rule in ("max_fit", "speed")}
  speed, max_fit = runs["speed"], runs["max_fit"]
  assert speed.job.plan.layout.nms == [2, 1] and speed.job.plan.layout.windows == [1, 1]
  assert max_fit.job.plan.layout.nms == [1, 1] and max_fit.job.plan.layout.windows is None
  assert speed.meta["nm"] == [2, 1] and speed.meta["window"] == [1, 1] and "window" not in max_fit.meta
  assert speed.examples_per_round == 3 * 32 and speed.batch_sizes == (64, 32)
  assert hetpipe.config(speed) == "2 virtual workers, Nm [2, 1], windows [1, 1], default placement"
  assert hetpipe.config(max_fit) == "2 virtual workers, Nm [1, 1], default placement"
  assert speed.images_per_sec > max_fit.images_per_sec
  assert hetpipe.label(PeerKnobs(policy="NP", nm_rule="speed"), 32) == "hetpipe NP speed, D=0"
  assert hetpipe.label(PeerKnobs(policy="NP"), 32) == "hetpipe NP, D=0"


def test_hetpipe_trains_the_windowed_layout_it_timed(monkeypatch):
  """The speed rule's layout (Nm [2, 1], windows [1, 1]) is what the trainer gets, windows included."""
  hetpipe = get_system("hetpipe")
  run = hetpipe.simulate(TWO_NODES, fixed(units(2), 32), 32, PeerKnobs(policy="NP", nm_rule="speed"))
  got = []

  def record(self, layout, waves, what):
    got.append(layout)
    raise _Stop  # (the layout is all this test needs)

  monkeypatch.setattr(Trainer, "train", record)
  with pytest.raises(_Stop):
    hetpipe.train(get_model("mlp"), synthetic(num_train=256, num_test=32), run,
                  TrainSetting(0, 0.05, "sgd", 0.5, 128, 32))
  assert got[0].nm == [2, 1] and got[0].window == [1, 1]


class _Stop(Exception):
  pass


def test_baseline_cli_takes_the_rule_and_refuses_a_bad_one_in_one_line(tmp_path):
  proc = cli("experiments.baseline", "--system=hetpipe", "--model=mlp", "--cluster=paper_mini", "--policy=NP",
             "--nm_rule=speed", f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  profiles = list(batch_profiles("mlp", 32, None)[0].at(32))
  plan = plan_cluster(get_cluster("paper_mini"), profiles, "NP", nm_policy="speed")
  assert f"'nm': {plan.layout.nms}" in proc.stdout and f"'window': {plan.layout.windows}" in proc.stdout
  bad = cli("experiments.baseline", "--system=hetpipe", "--nm_rule=fastest", f"--out_dir={tmp_path}")
  assert bad.returncode != 0 and bad.stderr.strip() == "error: --nm_rule=fastest; give one of max_fit, best, speed"
  with pytest.raises(ConfigError, match="--nm_rule=7; give one of max_fit, best, speed"):
    PeerKnobs(nm_rule="7").validate()


def _study(nms: tuple[str, ...], convergence=()):
  config = ThroughputConfig(get_cluster("paper_mini"), models=("mlp",), waves=4, ds=(0,), sub_studies=(),
                            tuned=False, systems=("hetero_dp",), nms=nms)
  return run_throughput(config, batch_profiles, convergence).models[0].table


def test_throughput_rows_of_another_rule_only_when_asked():
  assert [e.row for e in _study(("max_fit",))] == ["hetero_dp", *POLICY_ROWS]
  table = {e.row: e for e in _study(("max_fit", "speed"))}
  assert list(table) == ["hetero_dp", "HetPipe NP D=0", "HetPipe NP speed D=0", "HetPipe ED D=0",
                         "HetPipe ED speed D=0", "HetPipe HD D=0", "HetPipe HD speed D=0"]
  profiles = list(batch_profiles("mlp", 32, None)[0].at(32))
  for policy in ("NP", "ED", "HD"):
    plan = plan_cluster(get_cluster("paper_mini"), profiles, policy, nm_policy="speed")
    assert table[f"HetPipe {policy} speed D=0"].signature == [plan.layout.nms, 0]
  assert table["HetPipe NP D=0"].signature == [[1, 1, 1, 1], 0]  # paper_mini's NP: one GPU per virtual worker
  assert table["HetPipe NP speed D=0"].config.endswith(", windows [1, 1, 1, 1], default placement")
  speed, max_fit = table["HetPipe NP speed D=0"].images_per_sec, table["HetPipe NP D=0"].images_per_sec
  assert speed is not None and max_fit is not None and speed > max_fit
  for bad in (("max_fit", "fast"), (), ("speed", "speed")):
    with pytest.raises(ConfigError, match=f"--nms={','.join(bad)}; give one or more of max_fit, best, speed, each"):
      ThroughputConfig(get_cluster("paper_mini"), nms=bad)


def test_a_speed_row_is_marked_by_the_convergence_runs_that_trained_its_configuration():
  """A convergence study at --nm=speed names its rows HetPipe NP D=0 and records their Nm: the speed row takes
  their mark, the max_fit row does not; a file with only a summary of that row marks the max_fit row alone."""
  nms = plan_cluster(get_cluster("paper_mini"), list(batch_profiles("mlp", 32, None)[0].at(32)), "NP",
                     nm_policy="speed").layout.nms
  head = {"time_axis": "cost model of mlp (batch 32) on paper_mini", "cluster": "paper_mini", "path": "c.json"}
  runs = [{"row": "HetPipe NP D=0", "system": "hetpipe", "nm": nms, "d": 0, "seed": s, "time_to_target_s": t}
          for s, t in ((0, 10.0), (1, 20.0))]
  marks = {e.row: (e.goodput, e.time_to_target_s) for e in _study(("max_fit", "speed"), [{**head, "runs": runs,
                                                                                          "summary": {}}])}
  assert marks["HetPipe NP speed D=0"] == ("reaches", 15.0)
  assert marks["HetPipe NP D=0"][0].startswith("not trained (the convergence study trained another")
  assert marks["HetPipe ED speed D=0"] == ("not trained", None)
  summary = {"NP": {"row": "HetPipe NP D=0", "missed": 0, "mean_time_to_target_s": 9.0}}
  marks = {e.row: (e.goodput, e.time_to_target_s) for e in _study(("max_fit", "speed"), [{**head, "runs": [],
                                                                                          "summary": summary}])}
  assert marks["HetPipe NP D=0"] == ("reaches", 9.0) and marks["HetPipe NP speed D=0"] == ("not trained", None)


def test_throughput_cli_refuses_a_bad_rule_in_one_line(tmp_path):
  proc = cli("experiments.throughput", "--nms=max_fit,fast", f"--out_dir={tmp_path}")
  assert proc.returncode != 0
  assert proc.stderr.strip() == "error: --nms=max_fit,fast; give one or more of max_fit, best, speed, each once"
