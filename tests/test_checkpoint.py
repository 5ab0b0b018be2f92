"""Checkpoint and resume (issue 10): a run killed at any moment and resumed ends bit-identical to the
same run never interrupted; a resume that would change the run, a damaged checkpoint, a missing one, an
unwritable directory: one clear error each."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import optax
import pytest

from hetpipe_jax import ConfigError, RunConfig, get_model, read_trace, run_hetpipe, synthetic

from helpers import assert_resumes_bit_identical, assert_trace_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "tests", "programs", "checkpointed_run.py")
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_program(out, *flags, timeout=300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, PROGRAM, str(out), *flags], capture_output=True, text=True,
                        timeout=timeout, env=ENV, cwd=ROOT)


def steps(ck) -> list[int]:
  return sorted(int(name) for name in os.listdir(ck) if name.isdigit()) if os.path.isdir(ck) else []


@pytest.mark.slow
def test_a_run_killed_at_any_moment_resumes_bit_identical(tmp_path):
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  whole.mkdir()
  killed.mkdir()
  assert run_program(whole).returncode == 0
  # Kill the second run (SIGKILL) at a random moment after its first checkpoint: maybe while it writes one.
  rng = random.Random()
  wait_for, extra = rng.choice([4, 8, 12, 16, 20]), rng.uniform(0.0, 0.3)
  proc = subprocess.Popen([sys.executable, PROGRAM, str(killed)], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 240
    while not any(s >= wait_for for s in steps(killed / "ck")) and proc.poll() is None:
      assert time.monotonic() < deadline, "no checkpoint appeared"
      time.sleep(0.01)
    time.sleep(extra)
  finally:  # killed whatever happened above: no process outlives the test
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  if proc.returncode == 0:  # it finished before the kill: nothing to resume from the middle
    pytest.skip(f"the run ended before the kill (checkpoint {wait_for} + {extra:.2f} s)")
  resumed = run_program(killed, "--resume")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from None" not in resumed.stdout
  assert (whole / "trace.jsonl").read_bytes() == (killed / "trace.jsonl").read_bytes(), (wait_for, extra)
  assert (whole / "metrics.json").read_bytes() == (killed / "metrics.json").read_bytes()
  np.testing.assert_array_equal(np.load(whole / "weights.npy"), np.load(killed / "weights.npy"))
  assert_trace_ok(read_trace(str(killed / "trace.jsonl")))
  assert len(steps(killed / "ck")) == 2  # keep_checkpoints=2


def _config(tmp_path, **kw):
  base = dict(cluster="uniform8", num_vws=2, stages=2, nm=2, d=1, waves=12, trace_path=str(tmp_path / "t.jsonl"),
              checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3, keep_checkpoints=5)
  return RunConfig.of(**{**base, **kw})


@pytest.mark.slow  # about 40 s (.ci/run runs it; the README's test command keeps under 10 minutes)
def test_resume_refuses_a_changed_run_and_reads_no_damaged_checkpoint(tmp_path):
  model, data = get_model("mlp"), synthetic()
  whole = run_hetpipe(model, data, _config(tmp_path))
  assert whole.checkpoints["saved"] == 4 and steps(tmp_path / "ck") == [3, 6, 9, 12]
  with pytest.raises(ConfigError, match=r"was made with d=1, this run has d=2; use the same value"):
    run_hetpipe(model, data, _config(tmp_path, d=2, resume=True))
  with pytest.raises(ConfigError, match=r"was made with learning_rate=0.05, this run has learning_rate=0.1"):
    run_hetpipe(model, data, _config(tmp_path, learning_rate=0.1, resume=True))
  # Damage the newest checkpoint's arrays: one line; without it, the older one is resumed.
  newest = tmp_path / "ck" / "12" / "arrays"
  for path in newest.rglob("*"):
    if path.is_file() and path.stat().st_size > 0:
      path.write_bytes(b"\0" * 7)
  with pytest.raises(ConfigError, match=r"checkpoint .*/12 cannot be read .*delete it to resume from an older one"):
    run_hetpipe(model, data, _config(tmp_path, resume=True))
  import shutil
  shutil.rmtree(tmp_path / "ck" / "12")
  resumed = run_hetpipe(model, data, _config(tmp_path, resume=True))
  assert resumed.checkpoints["resumed_from"] == 9
  assert resumed.events == whole.events and resumed.metrics == whole.metrics
  assert_trace_ok(resumed.events)


@pytest.mark.slow  # 10-16 s: the fast suite keeps under 10 minutes
def test_a_wall_run_resumed_from_a_middle_checkpoint_passes_the_checker(tmp_path):
  """On real threads the cut waits until no device runs a task; a resume goes on from its clock."""
  import shutil
  model, data = get_model("mlp"), synthetic()
  whole = run_hetpipe(model, data, _config(tmp_path, executor="wall", failures=[(1, 7)], rejoin=True))
  assert_trace_ok(whole.events)
  assert steps(tmp_path / "ck") == [3, 6, 9, 12]
  for step in (9, 12):  # as if the run had been killed after its checkpoint at global clock 6
    shutil.rmtree(tmp_path / "ck" / str(step))
  resumed = run_hetpipe(model, data, _config(tmp_path, executor="wall", failures=[(1, 7)], rejoin=True,
                                             resume=True))
  assert resumed.checkpoints["resumed_from"] == 6
  events = read_trace(str(tmp_path / "t.jsonl"))
  assert events == resumed.events
  assert_trace_ok(events)
  assert all(max(e["wave"] for e in events if e["ev"] == "push" and e["vw"] == vw) == 11 for vw in (0, 1))
  assert [e["ev"] for e in events if e["ev"] in ("leave", "join")] == ["leave", "join"]


def test_a_truncated_trace_cannot_be_resumed(tmp_path):
  run_hetpipe(get_model("mlp"), synthetic(), _config(tmp_path))
  (tmp_path / "t.jsonl").write_text((tmp_path / "t.jsonl").read_text()[:500])
  with pytest.raises(ConfigError, match=r"trace .* holds \d+ complete events, the checkpoint needs its first"):
    run_hetpipe(get_model("mlp"), synthetic(), _config(tmp_path, resume=True))


@pytest.mark.parametrize("change,message", [
    (dict(resume=True), r"resume: no complete checkpoint in .*; run without resume to start afresh"),
    (dict(checkpoint_dir="/dev/null/ck"), r"checkpoint_dir='/dev/null/ck' is not writable"),
    (dict(executor="sim"), r"checkpoints are for runs with numerics; the sim executor has none"),
    (dict(checkpoint_every=0), r"checkpoint_every=0; save every 1 or more global clock ticks"),
    (dict(keep_checkpoints=0), r"keep_checkpoints=0; keep at least 1 checkpoint"),
    (dict(trace_path=None), r"checkpoint_dir needs trace_path"),
])
def test_checkpoint_settings_that_cannot_work_are_one_line(tmp_path, change, message):
  with pytest.raises(ConfigError, match=message):
    run_hetpipe(get_model("mlp"), synthetic(), _config(tmp_path, **change))


@pytest.mark.slow
@pytest.mark.parametrize("ps_rule", [dict(ps_tx=optax.trace(decay=0.5)),
                                     dict(ps_optimizer="delayed_nesterov:lr=0.8,momentum=0.9"),
                                     dict(ps_optimizer="heloco:lr=1.5,momentum=0.8")])
def test_a_stopped_run_with_optimizer_state_resumes_bit_identical(tmp_path, monkeypatch, ps_rule):
  """Momentum on every stage and momentum on the parameter server (a rule of one's own; Delayed Nesterov, whose
  state is its momentum, the round's buffer and its count; HeLoCo's momentum; both weigh the unequal waves' pushes by
  their shares): a resume must restore both optimizer states (SGD
  has none, so a resume that re-initialised them would pass the SGD tests)."""
  model, data = get_model("mlp"), synthetic()
  config = lambda out, **kw: _config(out, executor="virtual", cluster="hetero4", stages=2, nm=(2, 1), waves=8,
                                     tx=optax.sgd(0.02, momentum=0.9), checkpoint_every=2, **ps_rule, **kw)
  run = lambda c: run_hetpipe(model, data, c)
  assert assert_resumes_bit_identical(monkeypatch, tmp_path, run, config, step=4) == [2, 4]


@pytest.mark.slow  # two short checkpointed runs and a resume
def test_a_version_2_run_resumes_in_version_2_and_refuses_version_1(tmp_path):
  model, data = get_model("mlp"), synthetic(num_train=256, num_test=32)
  whole = run_hetpipe(model, data, _config(tmp_path, waves=6, trace_version=2))
  assert whole.events[0]["version"] == 2 and steps(tmp_path / "ck") == [3, 6]
  with pytest.raises(ConfigError, match=r"^resume: the trace .*t.jsonl is of version 2, the run asks for "
                                        r"trace_version=1; resume with trace_version=2$"):
    run_hetpipe(model, data, _config(tmp_path, waves=6, resume=True))
  assert read_trace(str(tmp_path / "t.jsonl")) == whole.events  # (refused before the file was touched)
  import shutil
  shutil.rmtree(tmp_path / "ck" / "6")
  resumed = run_hetpipe(model, data, _config(tmp_path, waves=6, trace_version=2, resume=True))
  assert resumed.checkpoints["resumed_from"] == 3
  assert resumed.events == whole.events == read_trace(str(tmp_path / "t.jsonl")) and resumed.metrics == whole.metrics
  assert_trace_ok(resumed.events)
