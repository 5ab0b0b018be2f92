"""The ``multiprocess`` executor on loopback: one process per node, decentralised, the same protocol.

Each run goes through the training CLI (which launches the processes) as a subprocess with a timeout.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hetpipe_jax import RunConfig, get_cluster, get_model, load_dataset, read_trace, run_hetpipe, synthetic
from hetpipe_jax.runtime.transport.launch import child_environment

from helpers import ROOT, TWO_NODES, assert_trace_ok, train_cli

ENV = child_environment()  # each launched process sets its own device count


def train(tmp_path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", *flags, timeout=timeout)


@pytest.mark.slow  # (15-18 s: the README's command keeps under 10 minutes; .ci/run runs it)
def test_four_processes_train_with_pipelines_across_nodes(tmp_path):
  """ED on hetero4: every virtual worker has one GPU on each of the 4 nodes, so every hop crosses processes."""
  proc = train(tmp_path, "--cluster=hetero4", "--policy=ED", "--d=1", "--waves=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "trace check: OK" in proc.stdout
  events = read_trace(str(tmp_path / "trace.jsonl"))
  stats = assert_trace_ok(events)
  meta = events[0]
  assert meta["executor"] == "multiprocess" and meta["stages"] == [4, 4]
  assert all(len({g.split(".")[0] for g in group}) == 4 for group in meta["gpus"])  # 4 nodes per VW
  tasks = [e for e in events if e["ev"] in ("fwd", "bwd")]
  # merged: every task carries the record of the process that ran it (the process of its GPU's node)
  assert all(e["process"] == int(meta["gpus"][e["vw"]][e["stage"]].split(".")[0][1:]) for e in tasks)
  assert all(0 < e["busy"] <= e["t1"] - e["t0"] + 1e-3 for e in tasks)  # inside the engine's interval
  assert stats["max_global_staleness"] is not None
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["final_test_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("ps_optimizer", ["add", "delayed_nesterov:lr=0.8,momentum=0.9", "heloco:lr=1.5,momentum=0.8"])
def test_one_vw_across_two_processes_is_plain_sgd(tmp_path, ps_optimizer):
  """Nm = 1, D = 0, one virtual worker whose 2 stages sit in 2 processes: the same losses as in one process, with
  the plain add at the parameter server and with a rule whose state each shard owner keeps (Delayed Nesterov's
  momentum, buffer and count, its round of N = 1 push resolved from the run)."""
  flags = ("--num_vws=1", "--stages=2", "--nm=1", "--d=0", "--waves=12", "--batch_size=32", "--seed=3")
  proc = train(tmp_path, f"--cluster={TWO_NODES}", *flags, f"--ps_optimizer={ps_optimizer}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  single = run_hetpipe(get_model("mlp"), synthetic(), RunConfig.of(
      cluster="uniform8", num_vws=1, stages=2, nm=1, d=0, waves=12, batch_size=32, seed=3,
      cuts=[events[0]["cuts"][0]], ps_optimizer=ps_optimizer))
  np.testing.assert_allclose([r["train_loss"] for r in rows], [r["train_loss"] for r in single.metrics],
                             rtol=1e-5)
  assert rows[-1]["train_loss"] < rows[0]["train_loss"]


@pytest.mark.slow  # (about 15 s)
def test_split_stages_train_across_processes_as_in_one(tmp_path):
  """Tensor parallelism across processes: one virtual worker of 2 stages (Nm = 1, D = 0: plain SGD whatever the
  timing), each split over its node's 2 GPUs (the process's 2 devices): a split stage's messages leave gathered
  on its first device, and the losses are those of the same run in one process."""
  cluster = os.path.join(ROOT, "tests", "data", "two_nodes_of_two.toml")
  flags = ("--num_vws=1", "--stages=2", "--tp=2", "--nm=1", "--d=0", "--waves=8", "--batch_size=16", "--seed=3")
  proc = train_cli(tmp_path, "--executor=multiprocess", f"--cluster={cluster}", "--dataset=tokens", "--model=gpt",
                   *flags, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert events[0]["tp"] == [[["n0.A.1"], ["n1.B.3"]]]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  data = load_dataset("tokens")
  single = run_hetpipe(get_model("gpt", data.num_classes), data, RunConfig.of(
      cluster=get_cluster(cluster), num_vws=1, stages=2, tp=2, nm=1, d=0, waves=8, batch_size=16, seed=3,
      cuts=[events[0]["cuts"][0]]))
  np.testing.assert_allclose([r["train_loss"] for r in rows if "train_loss" in r],
                             [r["train_loss"] for r in single.metrics if "train_loss" in r], rtol=1e-5)


def start_long_job(tmp_path) -> tuple[subprocess.Popen, int]:
  """Starts a long 2-process job; returns the launcher and, once it runs, process 1's pid."""
  proc = subprocess.Popen([sys.executable, "-m", "experiments.train", "--executor=multiprocess",
                           f"--cluster={TWO_NODES}", "--dataset=synthetic", "--model=mlp", "--num_vws=1",
                           "--stages=2", "--waves=100000", f"--out_dir={tmp_path}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:  # wait until process 1 runs
    out = running(tmp_path, "--process_id=1")
    if out:
      time.sleep(15)  # let it join and train
      return proc, out[0]
    time.sleep(0.5)
  proc.terminate()
  proc.communicate(timeout=30)
  raise AssertionError("process 1 never started")


def running(tmp_path, pattern: str = "") -> list[int]:
  """The pids of this test's job processes (matching ``pattern`` too)."""
  out = subprocess.run(["pgrep", "-f", "--", f"--out_dir={tmp_path} .*{pattern}"], capture_output=True, text=True)
  return [int(pid) for pid in out.stdout.split()]


@pytest.mark.slow
def test_a_killed_process_that_held_the_only_vw_ends_the_job_with_one_line(tmp_path):
  proc, victim = start_long_job(tmp_path)
  try:
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t_kill < 90
  finally:
    if proc.poll() is None:  # the launcher kills its processes on SIGTERM (and they die with it anyway)
      proc.terminate()
      proc.communicate(timeout=30)
  assert proc.returncode == 1, err[-3000:]
  verdict = [line for line in err.splitlines() if line.startswith("error")]  # its one VW spans both processes
  # whichever process 0 notices first: the VW's task failing there, or the loss of the PS shards it held
  assert len(verdict) == 1 and re.search(r"process 1 (\(node 1\) )?is gone", verdict[0]), err[-3000:]
  assert not running(tmp_path), "orphan processes"


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_orphans(tmp_path):
  proc, _ = start_long_job(tmp_path)
  proc.kill()  # SIGKILL: no clean-up runs in the launcher; its children die with it
  proc.communicate(timeout=30)
  deadline = time.monotonic() + 30
  while running(tmp_path) and time.monotonic() < deadline:
    time.sleep(0.5)
  assert not running(tmp_path), "orphan processes after the launcher was killed"


@pytest.mark.parametrize("flags,message", [
    (("--num_processes=3", "--process_id=0", "--coordinator_address=127.0.0.1:1"),
     "--num_processes=3 but cluster 'two_nodes' has 2 nodes"),
    (("--num_processes=2", "--process_id=7", "--coordinator_address=127.0.0.1:1"),
     "--process_id=7; give each of the 2 processes a distinct id in 0..1"),
])
def test_bad_process_flags_are_one_line(tmp_path, flags, message):
  proc = train(tmp_path, f"--cluster={TWO_NODES}", "--num_vws=1", *flags, timeout=120)
  assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # (two processes: about 15 s)
def test_a_slowed_process_runs_its_tasks_that_many_times_as_long_in_its_window(tmp_path):
  """--slow=1:3@0-1e9: every task of node 1's process lasts 3 times its own computing (a real delay), node 0's
  as before; the run finishes and its trace checks. Outside its window a slow does nothing."""
  flags = ("--num_vws=1", "--stages=2", "--nm=2", "--d=0", "--waves=6", f"--cluster={TWO_NODES}")
  proc = train(tmp_path, *flags, "--slow=1:3@0-1e9")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert events[0]["slow"] == [[1, 3.0, 0.0, 1e9]]
  tasks = [e for e in events if e["ev"] in ("fwd", "bwd")]
  slowed = [e["t1"] - e["t0"] - 3 * e["busy"] for e in tasks if e["process"] == 1]
  assert slowed and min(slowed) > -1e-3, slowed  # (each at least 3 x its computing)
  assert all(e["t1"] - e["t0"] < 2 * e["busy"] + 0.05 for e in tasks if e["process"] == 0)
  later = train(tmp_path / "later", *flags, "--slow=1:3@1e8-1e9")
  assert later.returncode == 0, later.stderr[-3000:]
  tasks = [e for e in read_trace(str(tmp_path / "later" / "trace.jsonl")) if e["ev"] in ("fwd", "bwd")]
  assert all(e["t1"] - e["t0"] < 2 * e["busy"] + 0.05 for e in tasks)


@pytest.mark.parametrize("flags, message", [
    (("--slow=1:3",), "write NODE:FACTOR@START-END"),
    (("--slow=1:0.5@0-10",), "a factor >= 1"),
    (("--slow=1:3@5-2",), "0 <= START < END"),
    (("--executor=virtual", "--slow=1:3@0-10"), "drop slow or use executor=multiprocess"),
])
def test_a_bad_slow_is_one_line(tmp_path, flags, message):
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", *flags,
                   f"--cluster={TWO_NODES}", "--num_vws=1", "--stages=2", "--waves=4")
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
