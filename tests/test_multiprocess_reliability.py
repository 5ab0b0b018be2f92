"""Reliability of the ``multiprocess`` executor: a lost process, a failed and replaced virtual worker, a
non-finite update, and checkpoint/resume, each through the training CLI on loopback (one process per node
of hetero4) as a subprocess with a timeout. Every run's trace passes the checker."""

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hetpipe_jax import read_trace
from hetpipe_jax.runtime.transport.launch import child_environment

from helpers import ROOT, assert_trace_ok, train_cli

ENV = child_environment()
FLAGS = ("--executor=multiprocess", "--dataset=synthetic", "--model=mlp", "--cluster=hetero4")

pytestmark = pytest.mark.slow  # 4 processes per run: ~20 s each on 2 cores


def train(tmp_path, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return train_cli(tmp_path, *FLAGS, *flags, timeout=timeout)


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


def test_an_injected_failure_of_a_virtual_worker_across_processes_is_a_leave(tmp_path):
  """ED: every virtual worker spans the 4 processes (process 0's included), so --fail cannot kill a process: VW 1's
  stage 0 tells the clock when it reaches wave 3, VW 1 leaves (its wave in flight dropped), and VW 0 pushes every
  wave; the run is decentralised (every copy of the shards says what it applied)."""
  proc = train(tmp_path, "--policy=ED", "--d=1", "--waves=8", "--fail=1@3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == 1 and leave["reason"] == "fault injected at wave 3", leave
  counts = pushes(events)
  assert counts[0] == 8 and counts[1] == leave["pushed"] <= 3, counts
  assert not [e for e in events if e["ev"] == "inject" and e["vw"] == 1 and e["mb"] > 3 * 4]  # (Nm 4)
  applied_exactly_once(events)


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


def _kill_when_written(tmp_path, victim: int | tuple[int, ...], lines: int, *flags: str
                       ) -> tuple[subprocess.CompletedProcess, list[dict]]:
  """Starts a job, SIGKILLs process ``victim`` (each of several, one after another) once the first one's
  trace part holds ``lines`` events (mid-run, at a moment the run decides), and waits for the job; returns its
  outcome and the whole events the part held just before the kill. The victims' pids are found while the part
  compiles and the part is read every 10 ms, so the kill lands within a few events of the mark (a part of 5 waves
  writes its 68 lines in about 0.2 s)."""
  victims = (victim,) if isinstance(victim, int) else victim
  part = tmp_path / f"trace.jsonl.part{victims[0]}"
  job = subprocess.Popen([sys.executable, "-m", "experiments.train", *FLAGS, f"--out_dir={tmp_path}", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
  try:
    deadline, pids = time.monotonic() + 240, {}
    while time.monotonic() < deadline and job.poll() is None:
      if part.exists():
        pids.update({v: _pid(tmp_path, v) for v in victims if not pids.get(v)})
        if len(part.read_text().splitlines()) >= lines:
          break
      time.sleep(0.01)
    text = part.read_text()
    written = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    for v in victims:
      pid = pids.get(v) or _pid(tmp_path, v)
      assert pid and job.poll() is None, "the job ended before it could be killed"
      os.kill(pid, signal.SIGKILL)
    out, err = job.communicate(timeout=240)
  finally:
    job.kill()
    job.wait(timeout=30)
  return subprocess.CompletedProcess(job.args, job.returncode, out, err), written


def _pid(tmp_path, process: int) -> int | None:
  """The pid of the job's process ``process``, if it runs."""
  pids = subprocess.run(["pgrep", "-f", "--", f"--out_dir={tmp_path} .*--process_id={process}"],
                        capture_output=True, text=True).stdout.split()
  return int(pids[0]) if pids else None


def applied_exactly_once(events) -> dict[int, set[int]]:
  """Asserts that every live copy of the PS shards applied every pushed wave of every VW once (its
  ``applied`` lines equal the pushes, and each wave was pushed once); returns each copy's units."""
  waves = [(e["vw"], e["wave"]) for e in events if e["ev"] == "push"]
  assert len(waves) == len(set(waves))  # each pushed wave once
  counts = pushes(events)
  lines = [e for e in events if e["ev"] == "applied"]
  assert lines and all(e["waves"] == counts[e["vw"]] for e in lines), (counts, lines)
  return {e["owner"]: set(e["units"]) for e in lines}


def _task(e: dict) -> tuple:
  return e["ev"], e["vw"], e["stage"], e["mb"], e["t0"]


def test_a_decentralised_run_goes_on_without_a_killed_process(tmp_path):
  """No fault injection (a decentralised run): NP with every PS shard on node 0; process 2, which holds VW
  2's stages only, is SIGKILLed mid-run. The clock learns it from process 0's watch, VW 2 leaves, the
  others push every wave; its waves pushed before stay applied once each, what it ran before its loss is read
  back from its part's file, and the merged trace passes the checker."""
  proc, written = _kill_when_written(tmp_path, 2, 60, "--policy=NP", "--placement=local", "--d=1", "--waves=30")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert len(written) >= 60
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == 2 and "process 2 is gone" in leave["reason"], leave
  counts = pushes(events)
  assert [counts[i] for i in (0, 1, 3)] == [30, 30, 30] and counts[2] == leave["pushed"] < 30, counts
  waves = [(e["vw"], e["wave"]) for e in events if e["ev"] == "push"]
  assert len(waves) == len(set(waves))  # each pushed wave once
  # process 2 died, its part with it: process 0 read back what its file held up to its last whole line, so what
  # VW 2 did before its loss is in the trace and checked, and its pushes' history is there
  ran = [e for e in events if e["ev"] in ("fwd", "bwd") and e["process"] == 2]
  held = {_task(e) for e in written if e["ev"] in ("fwd", "bwd")}
  assert {e["process"] for e in events if e["ev"] in ("fwd", "bwd")} == {0, 1, 2, 3} and len(held) >= 10
  assert held <= {_task(e) for e in ran}, held - {_task(e) for e in ran}  # all it held before the kill, kept
  assert {e["vw"] for e in ran} == {2} and not [e for e in events if e.get("history") == "lost"]


def test_a_checkpointed_run_stops_at_the_boundary_after_a_loss_and_resumes_with_every_process(tmp_path):
  """NP with every PS shard on node 0, checkpoints every 10 waves: process 2 is SIGKILLed early in the first part (its
  first events written, some 120 to come); VW 2 leaves, the others finish the part, and the job stops there in one
  line after a checkpoint at clock 10. Resumed with every process, VW 2 joins at clock 10 and every VW pushes waves
  10 to 19; one trace checks."""
  flags = ("--policy=NP", "--placement=local", "--d=1", "--waves=20", f"--checkpoint_dir={tmp_path / 'ck'}",
           "--checkpoint_every=10")
  proc, _ = _kill_when_written(tmp_path, 2, 1, *flags)
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "processes [2] were lost before wave 10" in errors[0], proc.stderr[-3000:]
  assert "resume from the checkpoint there (--resume) with every process" in errors[0]
  assert (tmp_path / "ck" / "10").exists()
  proc = train(tmp_path, *flags, "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "checkpoints: resumed from global clock 10" in proc.stdout
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  members = [(e["ev"], e.get("clock")) for e in events if e["ev"] in ("leave", "join") and e["vw"] == 2]
  assert members == [("leave", None), ("join", 10)], members
  counts = pushes(events)
  assert [counts[i] for i in (0, 1, 3)] == [20, 20, 20] and counts[2] < 20, counts
  assert sorted(e["wave"] for e in events if e["ev"] == "push" and e["vw"] == 2)[-10:] == list(range(10, 20))


def test_a_process_lost_before_a_part_starts_stops_the_run_in_one_line(tmp_path):
  """Process 2 is SIGKILLed as soon as its trace part exists (the part is compiling or connecting, before its
  clocks start): nothing of the part ran, so the run stops in one line, naming the process and what to do,
  instead of a transport error (the others had been waiting to connect to it)."""
  flags = ("--policy=NP", "--placement=local", "--d=1", "--waves=15", f"--checkpoint_dir={tmp_path / 'ck'}",
           "--checkpoint_every=5")
  proc, written = _kill_when_written(tmp_path, 2, 0, *flags)
  assert proc.returncode == 1 and not written, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "processes [2] were lost before wave 0" in errors[0] and "run again" in errors[0], errors[0]


@pytest.mark.parametrize("victim, lines", [(1, 40), (2, 100), (3, 70)])
def test_a_decentralised_run_goes_on_without_a_shard_owner(tmp_path, victim, lines):
  """NP with the PS shards spread over the nodes, each with a backup in the next process: the process of
  VW ``victim``, which holds primary shards and backs up another's, is SIGKILLed mid-run (the kill points
  differ: before, around and after the wave updates in flight). VW ``victim`` leaves, the backups serve its
  primaries, the others push every wave, and every live copy applied every pushed wave exactly once: the
  waves the clock counted (those every copy held) and no other."""
  proc, _ = _kill_when_written(tmp_path, victim, lines, "--policy=NP", "--d=1", "--waves=30")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)  # (its "applied" rule: every copy's count equals the pushes)
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == victim and f"process {victim} is gone" in leave["reason"], leave
  counts = pushes(events)
  assert all(counts[i] == 30 for i in range(4) if i != victim) and counts[victim] == leave["pushed"] < 30, counts
  copies = applied_exactly_once(events)
  assert victim not in copies and set().union(*copies.values()) == set(range(4)), copies  # every unit, elsewhere
  primaries = set(range(4)) - {u for e in events if e["ev"] == "applied" for u in e["primary"]}
  assert primaries and primaries <= copies[(victim + 1) % 4], copies  # the victim's, kept by its backup


def test_a_decentralised_run_stops_in_one_line_without_both_copies_of_a_shard(tmp_path):
  """Processes 1 and 2 (unit 0's primary and its backup) are SIGKILLed: the job stops in one line."""
  proc, _ = _kill_when_written(tmp_path, (1, 2), 40, "--policy=NP", "--d=1", "--waves=30")
  assert proc.returncode == 1
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "every copy of the PS shards of units" in errors[0], errors[0]


def test_a_decentralised_run_stops_in_one_line_without_a_virtual_worker(tmp_path):
  """ED: every VW has a stage on every node, so losing process 2 leaves none to go on."""
  proc, _ = _kill_when_written(tmp_path, 2, 40, "--policy=ED", "--d=1", "--waves=30")
  assert proc.returncode == 1
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "process 2 is gone, and every virtual worker had left or had a stage there" in errors[0], errors[0]


def test_a_decentralised_virtual_worker_across_a_lost_process_leaves(tmp_path):
  """HD with the shards on nodes 0 and 2: VW 0 has stages on processes 0 and 3. Process 3 is SIGKILLed
  mid-run: VW 0 leaves (its stages on process 0 end), VW 1 pushes every wave, and the trace passes."""
  proc, _ = _kill_when_written(tmp_path, 3, 60, "--policy=HD", "--placement=local", "--d=1", "--waves=20")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == 0 and "process 3 is gone" in leave["reason"], leave
  counts = pushes(events)
  assert counts[1] == 20 and counts[0] == leave["pushed"] < 20, counts
