"""The experiment command lines end to end, each in its own process (it sets up its own CPU devices)."""

import json
import os
import re
import subprocess
import sys

import pytest

from hetpipe_jax import read_trace

from helpers import assert_trace_ok

ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def run_module(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=timeout, env=ENV)


# the wall executor's run (about 40 s) is slow-marked: .ci/run runs it; the README's command keeps < 10 min
@pytest.mark.parametrize("executor", ["virtual", pytest.param("wall", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_train_cli_writes_outputs_the_checker_accepts(tmp_path, executor):
  trace = tmp_path / "t.jsonl"
  proc = run_module("experiments.train", "--num_vws=3", "--stages=2", "--nm=3", "--d=1", "--waves=6",
                    f"--executor={executor}", f"--trace_out={trace}", f"--out_dir={tmp_path}", "--eval_every=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "trace check: OK" in proc.stdout
  events = read_trace(str(trace))
  assert events[0]["executor"] == executor and events[0]["num_vws"] == 3
  assert_trace_ok(events)
  check = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(trace)], capture_output=True,
                         text=True, timeout=120)
  assert check.returncode == 0 and "OK" in check.stdout
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 3 * 6
  assert all({"vw", "wave", "step", "time", "train_loss"} <= set(r) for r in rows)
  assert sum("test_accuracy" in r for r in rows) >= 2
  assert (tmp_path / "training.png").stat().st_size > 10_000
  assert (tmp_path / "timeline.png").stat().st_size > 10_000
  assert json.loads((tmp_path / "timeline.chrome.json").read_text())["traceEvents"]
  for name in ("metrics.jsonl", "summary.json", "training.png", "timeline.png", "timeline.chrome.json"):
    assert str(tmp_path / name) in proc.stdout


@pytest.mark.slow  # (15-18 s: the README's command keeps under 10 minutes; .ci/run runs it)
def test_one_cuts_list_serves_every_virtual_worker_and_sets_the_stages(tmp_path):
  proc = run_module("experiments.train", "--dataset=digits", "--cuts=0,1,3,5", "--num_vws=2", "--waves=2",
                    f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  meta = events[0]
  assert meta["cuts"] == [[0, 1, 3, 5], [0, 1, 3, 5]] and meta["stages"] == [3, 3]


@pytest.mark.parametrize("module, args, message", [
    ("experiments.train", ["--seed=-5"], r"--seed=-5; a seed must be in \[0, 2\*\*63 - 1\]"),
    ("experiments.train", ["--cuts=0,2,5;0,3,5"], r"--cuts=0,2,5;0,3,5 gives 2 lists of boundaries for "
                                                  r"--num_vws=3; give one list for every virtual worker"),
    ("experiments.train", ["--stages=two"], r"--stages=two must be integers"),
    ("experiments.convergence", ["--seeds=0,-1"], r"--seeds=-1; a seed must be in"),
    ("experiments.convergence", ["--ds=0,x"], r"--ds=0,x must be integers"),
    ("experiments.convergence", ["--tuned_objective=measured", "--pilots=0"], r"--pilots=0; --tuned_objective="
                                                                              r"measured needs at least 1"),
    ("experiments.convergence", ["--tuned_objective=measured", "--pilot_seed=1"], r"--pilot_seed=1 is one of "
                                                                                  r"--seeds; use a seed outside"),
    ("experiments.plan", ["--optimizer=lion"],
     r"unknown optimizer 'lion'; choose one of sgd, momentum, adam, adamw, muon"),
    ("experiments.plan", ["--activations=torch"], r"activations='torch'; use jax .* or eager"),
    ("experiments.baseline", ["--activations=torch"], r"activations='torch'; use jax .* or eager"),
    ("experiments.throughput", ["--optimizer=lion"], r"unknown optimizer 'lion'"),
    ("experiments.validate_sim", ["--waves=0"], r"waves=0; run at least 1 wave"),
    ("experiments.ablation", ["--base=4,4"], r"--base=4,4; give N,Nm,D, e.g. 4,4,0"),
    ("experiments.ablation", ["--lrs=0.1,fast"], r"--lrs=0.1,fast; give numbers"),
])
@pytest.mark.slow
def test_every_script_reports_a_bad_configuration_in_one_line(module, args, message):
  proc = run_module(module, *args, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), proc.stderr[-3000:]
  assert re.search(message, last), last
