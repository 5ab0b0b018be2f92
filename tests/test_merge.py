"""One trace from many writers (hetpipe_jax/core/merge.py): the parts of a real decentralised run
(tests/data/decentral_run) merge into a trace every WSP guarantee holds on, by causal keys only: a skew
between the processes' clocks changes nothing, a planted cross-process reordering is caught by the checker,
and a run that died merges as far as its parts allow."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax.core.check import check_trace
from hetpipe_jax.core.merge import merge, provides, requires
from hetpipe_jax.core.trace import read_whole_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "tests", "data", "decentral_run")


def _read(name: str) -> list[dict]:
  with open(os.path.join(RUN, name), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


META = _read("meta.jsonl")[0]
PARTS = [_read("part0.jsonl"), _read("part1.jsonl")]


def _rules(events) -> set[str]:
  return {v.rule for v in check_trace(events)}


def test_the_parts_of_a_run_merge_into_a_sound_trace():
  events, left, dropped = merge(META, PARTS)
  assert left == dropped == 0 and len(events) == 1 + sum(map(len, PARTS))
  assert check_trace(events) == []
  assert {e["process"] for e in events[1:]} == {0, 1}
  # every stage's tasks crossed processes: each VW has a stage in each part
  assert {(e["vw"], e["process"]) for e in events if e["ev"] == "fwd"} == {(0, 0), (0, 1), (1, 0), (1, 1)}
  # each event comes after what it causally follows
  seen = set()
  for line, e in enumerate(events[1:], start=2):
    for key in requires(e, META["nm"], META["stages"]):
      assert key in seen, (line, e)
    seen.add(provides(e))


@pytest.mark.parametrize("skew", [-10.0, -0.01, 0.01, 10.0])
def test_a_skew_between_the_clocks_changes_nothing_causal(skew):
  """Process 1's clock moved by ``skew`` seconds: the merge still puts every event after what it follows
  (it never compares the processes' clocks), and the checker compares times only within a process."""
  shifted = [{**e, **{f: e[f] + skew for f in ("t", "t0", "t1") if f in e}} for e in PARTS[1]]
  events, left, _ = merge(META, [PARTS[0], shifted])
  assert left == 0 and check_trace(events) == []
  events, left, _ = merge(META, [shifted, PARTS[0]])  # the parts in the other order
  assert left == 0 and check_trace(events) == []


def _move_before(events, moved, anchor):
  """``events`` with the event ``moved`` put just before ``anchor``."""
  rest = [e for e in events if e is not moved]
  at = next(i for i, e in enumerate(rest) if e is anchor)
  return rest[:at] + [moved] + rest[at:]


def test_a_planted_cross_process_reordering_is_caught():
  events, _, _ = merge(META, PARTS)
  # a forward at the stage in one process before its input's forward in the other
  late = next(e for e in events if e["ev"] == "fwd" and e["stage"] == 1 and e["mb"] == 3)
  early = next(e for e in events if e["ev"] == "fwd" and e["stage"] == 0 and e["mb"] == 3 and e["vw"] == late["vw"])
  assert late["process"] != early["process"]
  assert "order" in _rules(_move_before(events, late, early))
  # a pull at a stage before a push its snapshot holds (the clock runs in the other process)
  pull = next(e for e in events if e["ev"] == "pull" and e["process"] != next(
      p["process"] for p in events if p["ev"] == "push") and max(e["glob"]) > 0)
  v = max(range(len(pull["glob"])), key=lambda k: pull["glob"][k])
  push = next(e for e in events if e["ev"] == "push" and e["vw"] == v and e["wave"] == pull["glob"][v] - 1)
  assert "global" in _rules(_move_before(events, pull, push))


def test_the_parts_of_a_run_that_died_merge_as_far_as_they_go():
  cut = PARTS[0][:20]  # process 0 died after writing 20 events
  events, left, _ = merge(META, [cut, PARTS[1]])
  assert left > 0 and len(events) - 1 + left == 20 + len(PARTS[1])
  assert _rules(events) <= {"end"}  # sound as far as it goes; the unfinished work is what "end" reports


def test_the_merge_command(tmp_path):
  out = tmp_path / "merged.jsonl"
  proc = subprocess.run([sys.executable, "-m", "hetpipe_jax.core.merge", str(out), os.path.join(RUN, "meta.jsonl"),
                         os.path.join(RUN, "part0.jsonl"), os.path.join(RUN, "part1.jsonl")],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "merged 87 events of 2 parts" in proc.stdout
  events = [json.loads(line) for line in out.read_text().splitlines()]
  assert events[0] == META and check_trace(events) == []


def test_the_time_rule_holds_per_process():
  events, _, _ = merge(META, PARTS)
  i = next(i for i, e in enumerate(events) if i > 10 and e.get("process") == 1 and "t" in e)
  bad = [*events[:i], {**events[i], "t": -1.0}, *events[i + 1:]]
  violations = [v for v in check_trace(bad) if v.rule == "time"]
  assert violations and "of process 1" in str(violations[0])


LOSS = os.path.join(ROOT, "tests", "data", "decentral_loss")


def _loss_run() -> tuple[dict, list[list[dict]]]:
  def read(name):
    with open(os.path.join(LOSS, name), encoding="utf-8") as f:
      return [json.loads(line) for line in f]
  return read("meta.jsonl")[0], [read(f"part{p}.jsonl") for p in range(4)]


def test_the_parts_of_a_run_that_lost_a_process_merge_into_a_sound_trace():
  """Process 3 died; what process 0 received (parts 0-2) merges: VW 0's events whose history died are left
  out, its 3 pushes stay (saying their history is lost), VW 1 pushed every wave, and the checker passes.
  With the dead process's own file too (it survives on one host), nothing is left out."""
  meta, parts = _loss_run()
  events, unplaced, dropped = merge(meta, parts[:3])
  assert unplaced == 0 and dropped > 0 and check_trace(events) == []
  (leave,) = [e for e in events if e["ev"] == "leave"]
  assert leave["vw"] == 0 and leave["pushed"] == 3
  pushed = [e for e in events if e["ev"] == "push"]
  assert [e["wave"] for e in pushed if e["vw"] == 0] == [0, 1, 2]
  assert all(e.get("history") == "lost" for e in pushed if e["vw"] == 0)
  assert [e["wave"] for e in pushed if e["vw"] == 1] == list(range(10))
  assert not [e for e in events if e["ev"] in ("fwd", "bwd", "inject") and e["vw"] == 0 and e["process"] == 3]
  events, unplaced, dropped = merge(meta, parts)
  assert unplaced == dropped == 0 and check_trace(events) == []
  assert not [e for e in events if e["ev"] == "push" and e.get("history")]


def test_a_pull_that_a_leave_opened_is_placed_after_it():
  """VW 1's gate opened because VW 0 left (its pulls name it in ``left``): the merge puts them after the
  leave, and the checker catches one planted before it."""
  meta, parts = _loss_run()
  events, _, _ = merge(meta, parts[:3])
  leave = next(i for i, e in enumerate(events) if e["ev"] == "leave")
  opened = [i for i, e in enumerate(events) if e["ev"] == "pull" and e.get("left") == [0]]
  assert opened and min(opened) > leave
  early = [e for e in events if e["ev"] != "leave"]
  early.insert(max(opened), events[leave])  # the leave after the last pull it opened
  assert "gate" in _rules(early)


def test_what_the_copies_applied_comes_after_the_pushes_it_counts():
  """An ``applied`` line (process 0 writes them last) goes after the push of the last wave it counts, also
  for a VW that left (what its copies applied of it still counts); the checker then holds it to the pushes."""
  meta, parts = _loss_run()
  pushed = {vw: sum(1 for part in parts[:3] for e in part if e["ev"] == "push" and e["vw"] == vw) for vw in (0, 1)}
  lines = [dict(ev="applied", vw=vw, owner=0, units=list(range(meta["shards"])), waves=waves, t=-1.0, process=9)
           for vw, waves in pushed.items()]  # (first in a part of their own, at a time before everything)
  events, unplaced, _ = merge(meta, [lines, *parts[:3]])
  assert unplaced == 0 and check_trace(events) == []
  last_push = max(i for i, e in enumerate(events) if e["ev"] == "push")
  assert [e["vw"] for e in events[last_push:] if e["ev"] == "applied"] == [0, 1] or \
      min(i for i, e in enumerate(events) if e["ev"] == "applied" and e["vw"] == 1) > last_push
  assert provides(lines[0]) is None and requires(lines[1], meta["nm"], meta["stages"]) == [("push", 1, pushed[1] - 1)]
  lines[1]["waves"] -= 1
  events, _, _ = merge(meta, [lines, *parts[:3]])
  assert "applied" in _rules(events)


def test_a_part_cut_short_is_read_up_to_its_last_whole_line(tmp_path):
  """What a killed process leaves: whole lines, then a line it was writing when it died (no newline, or not
  JSON yet); the reader keeps the whole ones, and a file that is not there gives nothing."""
  path = tmp_path / "trace.jsonl.part2"
  path.write_text('{"ev":"inject","vw":2,"mb":1,"t":0.5}\n{"ev":"inject","vw":2,"mb":2,"t":0.7}\n{"ev":"fw')
  assert [e["mb"] for e in read_whole_lines(str(path))] == [1, 2]
  path.write_text('{"ev":"inject","vw":2,"mb":1,"t":0.5}\n{"ev":"inject","vw":2,"mb":2,"t":0.7}')  # (no newline)
  assert [e["mb"] for e in read_whole_lines(str(path))] == [1]
  assert read_whole_lines(str(tmp_path / "absent")) == []
