"""Reliability of the ``multiprocess`` executor: a lost process, a failed and replaced virtual worker, a
non-finite update, and checkpoint/resume, each through the training CLI on loopback (one process per node
of hetero4) as a subprocess with a timeout. Every run's trace passes the checker."""

import collections
import os
import signal
import subprocess
import sys
import time

import pytest

from hetpipe_jax import read_trace
from hetpipe_jax.runtime.launch import child_environment

from helpers import assert_trace_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_environment()
FLAGS = ("--executor=multiprocess", "--dataset=synthetic", "--model=mlp", "--cluster=hetero4")

pytestmark = pytest.mark.slow  # 4 processes per run: ~20 s each on 2 cores


def train(tmp_path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.train", *FLAGS, f"--out_dir={tmp_path}", *flags],
                        capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def pushes(events) -> collections.Counter:
  return collections.Counter(e["vw"] for e in events if e["ev"] == "push")


def test_a_crashed_process_leaves_and_the_others_go_on(tmp_path):
  """NP with every PS shard on node 0 (--placement=local): --fail kills node 2's process (SIGKILL) at
  wave 3; process 0 finds it gone, VW 2 leaves and the others finish their waves under WSP."""
  proc = train(tmp_path, "--policy=NP", "--placement=local", "--d=1", "--waves=10", "--fail=2@3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "lost during the run: node 2 (process 2) was killed by signal 9" in proc.stdout, proc.stdout[-2000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == 2 and "process 2 is gone" in leave["reason"], leave
  counts = pushes(events)  # the waves it pushed before wave 3 began stay applied; the rest never came
  assert counts[2] == leave["pushed"] <= 3 and [counts[i] for i in (0, 1, 3)] == [10, 10, 10], counts
  assert not [e for e in events if e["ev"] == "join"]  # nothing can replace it where it ran


def test_a_failed_virtual_worker_is_replaced_across_processes(tmp_path):
  """ED: every virtual worker spans the 4 processes, so an injected fault fails VW 1 in software; with
  --rejoin a replacement pulls the global weights and enters at the global clock."""
  proc = train(tmp_path, "--policy=ED", "--d=1", "--waves=8", "--fail=1@3", "--rejoin")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  kinds = [e["ev"] for e in events if e["ev"] in ("leave", "join") and e["vw"] == 1]
  assert kinds == ["leave", "join"], kinds
  assert all("process" in e for e in events if e["ev"] in ("fwd", "bwd"))  # every task's record merged


def test_a_nonfinite_update_is_skipped_or_stops_the_job_in_one_line(tmp_path):
  flags = ("--policy=NP", "--waves=6", "--learning_rate=1e4")
  proc = train(tmp_path / "skip", *flags, "--on_nonfinite=skip")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "skip" / "trace.jsonl"))
  assert_trace_ok(events)
  assert [e for e in events if e["ev"] == "push" and e.get("dropped") == "nonfinite"]

  proc = train(tmp_path / "stop", *flags)
  assert proc.returncode == 1
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "pushed a non-finite update" in errors[0] and "stage" in errors[0] and "global clock" in errors[0]


def test_a_killed_job_resumes_from_its_checkpoint(tmp_path):
  """The launcher is SIGKILLed (its processes die with it) after the checkpoint at global clock 10; the
  resumed job gathers nothing twice and its trace passes the checker."""
  flags = ("--policy=ED", "--d=1", "--waves=40", f"--checkpoint_dir={tmp_path / 'ck'}", "--checkpoint_every=5")
  job = subprocess.Popen([sys.executable, "-m", "experiments.train", *FLAGS, f"--out_dir={tmp_path}", *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
  try:
    deadline = time.monotonic() + 240
    while not (tmp_path / "ck" / "10").exists() and job.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    assert job.poll() is None, "the job ended before it could be killed"
    job.send_signal(signal.SIGKILL)
  finally:
    job.kill()
    job.wait(timeout=30)
  proc = train(tmp_path, *flags, "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "checkpoints: resumed from global clock" in proc.stdout
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert pushes(events) == {0: 40, 1: 40}
  tasks = collections.Counter((e["ev"], e["vw"], e["stage"], e["mb"]) for e in events if e["ev"] in ("fwd", "bwd"))
  assert set(tasks.values()) == {1}  # rolled back to the checkpoint: no task twice
