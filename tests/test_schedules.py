"""Golden schedules: the pure schedule's unit-time tables asserted literally (no engine), and the engine's
per-device task orders of one virtual worker, fwd = 1 and bwd = 1 time unit.

Hand-derived for k = 2, Nm = 2 (1F1B)::

  t      0    1    2    3    4    5    6    7   ...
  dev0   F1   F2   .    B1   F3   B2   F4   B3  ...   mb 3 waits for mb 1 to complete (Nm window)
  dev1   .    F1   B1   F2   B2   F3   B3   F4  ...   backward first once B1 is ready at t = 2
"""

import itertools

import pytest

from hetpipe_jax.core import schedule
from hetpipe_jax.errors import ProtocolError

from helpers import assert_trace_ok, schedule_only

TABLES = {  # (k, Nm, minibatches, schedule, backward ticks): one row per device, one column per tick
    (2, 2, 6, "1f1b", 1): [
        "F1 F2 .  B1 F3 B2 F4 B3 F5 B4 F6 B5 .  B6",
        ".  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .",
    ],
    (4, 4, 8, "1f1b", 1): [
        "F1 F2 F3 F4 .  .  .  B1 F5 B2 F6 B3 F7 B4 F8 B5 .  B6 .  B7 .  B8",
        ".  F1 F2 F3 F4 .  B1 .  B2 F5 B3 F6 B4 F7 B5 F8 B6 .  B7 .  B8 .",
        ".  .  F1 F2 F3 B1 F4 B2 .  B3 F5 B4 F6 B5 F7 B6 F8 B7 .  B8 .  .",
        ".  .  .  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8 .  .  .",
    ],
    (3, 2, 6, "fifo", 2): [
        "F1 F2 .  .  .  .  .  .  B1 B1 F3 B2 B2 F4 .  .  .  B3 B3 F5 B4 B4 F6 .  .  .  B5 B5 .  B6 B6",
        ".  F1 F2 .  .  .  B1 B1 B2 B2 .  F3 .  .  F4 B3 B3 .  B4 B4 F5 .  .  F6 B5 B5 .  B6 B6 .  .",
        ".  .  F1 F2 B1 B1 B2 B2 .  .  .  .  F3 B3 B3 F4 B4 B4 .  .  .  F5 B5 B5 F6 B6 B6 .  .  .  .",
    ],
    # GPipe: a wave's forwards, then its backwards; the next wave only after a flush
    (3, 3, 6, "gpipe", 1): [
        "F1 F2 F3 .  .  .  .  B1 B2 B3 F4 F5 F6 .  .  .  .  B4 B5 B6",
        ".  F1 F2 F3 .  .  B1 B2 B3 .  .  F4 F5 F6 .  .  B4 B5 B6 .",
        ".  .  F1 F2 F3 B1 B2 B3 .  .  .  .  F4 F5 F6 B4 B5 B6 .  .",
    ],
}


@pytest.mark.parametrize("case", list(TABLES), ids=str)
def test_pure_schedule_golden_table(case):
  assert [" ".join(row) for row in schedule.timetable(*case)] == [" ".join(r.split()) for r in TABLES[case]]


@pytest.mark.parametrize("k,nm,name", list(itertools.product((1, 2, 3, 4), (1, 2, 3, 5), schedule.SCHEDULES)))
def test_engine_follows_the_pure_schedule(k, nm, name):
  """The engine on the virtual executor (unit task times) runs each device's tasks in the timetable's order."""
  events = schedule_only([k], [nm], d=0, waves=3, slowdown=[1.0], schedule=name, bwd=1.0)
  assert_trace_ok(events)
  table = schedule.timetable(k, nm, 3 * nm, name)
  want = {j: " ".join(x for x in row if x != ".") for j, row in enumerate(table)}
  assert device_orders(events, k) == want


def test_schedule_state_is_pure_and_checks_its_moves():
  state = schedule.init(2)
  state, mb = schedule.inject(state, "1f1b")
  task = schedule.pick(state, 0)
  assert (mb, task) == (1, schedule.Task(0, 0, "fwd", 1))
  assert schedule.pick(state, 0) == task and schedule.pick(state, 1) is None  # pick changes nothing
  busy = schedule.start(state, task)
  assert schedule.pick(busy, 0) is None and state.busy == (None, None)
  with pytest.raises(ProtocolError, match="while running"):
    schedule.start(busy, task)
  state, completed = schedule.finish(busy, task, "1f1b")
  assert not completed and schedule.pick(state, 1) == schedule.Task(0, 1, "fwd", 1)
  with pytest.raises(ProtocolError, match="was running None"):
    schedule.finish(state, task, "1f1b")  # not running any more
  early = schedule.Task(0, 0, "bwd", 2)
  with pytest.raises(ProtocolError, match="completed before"):
    schedule.finish(state._replace(busy=(early, None)), early, "1f1b")


def device_orders(events, k):
  return {j: " ".join(("F" if e["ev"] == "fwd" else "B") + str(e["mb"]) for e in events
                      if e["ev"] in ("fwd", "bwd") and e["stage"] == j) for j in range(k)}


GOLDEN = [
    # (k, Nm, waves, schedule, bwd time): {stage: order}
    ((2, 1, 3, "1f1b", 1.0), {0: "F1 B1 F2 B2 F3 B3", 1: "F1 B1 F2 B2 F3 B3"}),
    ((2, 2, 3, "1f1b", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 2, 3, "1f1b", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 F2 B1 B2 F3 F4 B3 B4 F5 F6 B5 B6",
                              2: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((4, 4, 2, "1f1b", 1.0), {0: "F1 F2 F3 F4 B1 F5 B2 F6 B3 F7 B4 F8 B5 B6 B7 B8",
                              1: "F1 F2 F3 F4 B1 B2 F5 B3 F6 B4 F7 B5 F8 B6 B7 B8",
                              2: "F1 F2 F3 B1 F4 B2 B3 F5 B4 F6 B5 F7 B6 F8 B7 B8",
                              3: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8"}),
    ((2, 2, 3, "fifo", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 F2 B1 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 3, 2, "1f1b", 2.0), {0: "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6",
                              1: "F1 F2 F3 B1 B2 F4 B3 F5 B4 F6 B5 B6",
                              2: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 3, 2, "fifo", 2.0), {0: "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6",
                              1: "F1 F2 F3 B1 B2 B3 F4 F5 F6 B4 B5 B6",
                              2: "F1 F2 B1 F3 B2 B3 F4 F5 B4 B5 F6 B6"}),
]


@pytest.mark.parametrize("case,expected", GOLDEN, ids=[str(c) for c, _ in GOLDEN])
def test_golden_schedule(case, expected):
  k, nm, waves, schedule, bwd = case
  events = schedule_only([k], [nm], d=0, waves=waves, slowdown=[1.0], schedule=schedule, bwd=bwd)
  assert_trace_ok(events)
  assert device_orders(events, k) == expected


@pytest.mark.parametrize("k,nm", [(2, 2), (4, 4), (4, 2), (3, 5)])
def test_schedule_invariants(k, nm):
  """Never more than Nm minibatches in flight; injection and completion in order; every task once."""
  events = schedule_only([k], [nm], d=0, waves=4, slowdown=[1.0], bwd=2.0)
  assert_trace_ok(events)
  in_flight, peak = 0, 0
  for e in events:
    in_flight += {"inject": 1, "complete": -1}.get(e["ev"], 0)
    peak = max(peak, in_flight)
  assert peak == min(nm, 4 * nm)
  assert [e["mb"] for e in events if e["ev"] == "complete"] == list(range(1, 4 * nm + 1))
  assert sum(e["ev"] in ("fwd", "bwd") for e in events) == 2 * k * 4 * nm


@pytest.mark.parametrize("name", sorted(schedule.SCHEDULES))
def test_a_stage_that_holds_only_its_part_follows_the_same_schedule(name):
  """A decentralised stage (hetpipe_jax/runtime/processes/stage_loop.py) holds the pipeline state and touches only its
  own stage: its task is released and the successor arrives where it runs. Driving k such views (each
  told of arrivals in the order finish would ready them) gives every device the tasks in the order one
  state driven by :func:`schedule.finish` gives it."""
  k, nm, total = 3, 2, 8
  whole = schedule.init(k)
  parts = [schedule.init(k) for _ in range(k)]
  order = {"whole": [[] for _ in range(k)], "parts": [[] for _ in range(k)]}
  running = []
  while whole.completed < total:
    while schedule.can_inject(whole, nm, total, name):
      whole, _ = schedule.inject(whole, name)
      parts[0], _ = schedule.inject(parts[0], name)
    for j in range(k):
      task = schedule.pick(whole, j)
      assert task == schedule.pick(parts[j], j)
      if task is not None:
        whole, parts[j] = schedule.start(whole, task), schedule.start(parts[j], task)
        running.append(task)
        order["whole"][j].append(task)
    task = running.pop(0)
    whole, completed = schedule.finish(whole, task, name)
    parts[task.stage], released = schedule.release(parts[task.stage], task)
    assert completed == released
    nxt = schedule.successor(task, k)
    if nxt is not None:
      stage, kind = nxt
      parts[stage] = schedule.arrive(parts[stage], schedule.Task(task.vw, stage, kind, task.mb), name)
  assert parts[0].completed == whole.completed == total
  for j in range(k):  # each view's own stage has nothing left, like the whole
    assert parts[j].ready[j] == whole.ready[j] == () and parts[j].busy[j] is None


def test_release_checks_its_moves():
  state = schedule.init(2)
  state, _ = schedule.inject(state, "1f1b")
  task = schedule.pick(state, 0)
  with pytest.raises(ProtocolError, match="finished but stage 0 was running None"):
    schedule.release(state, task)
  state = schedule.start(state, task)
  state, completed = schedule.release(state, task)
  assert not completed and state.busy == (None, None) and state.ready == ((), ())  # the successor is elsewhere
  late = schedule.Task(0, 0, schedule.BWD, 2)
  state = schedule.start(schedule.arrive(state, late, "1f1b"), late)
  with pytest.raises(ProtocolError, match="minibatch 2 completed before 1"):
    schedule.release(state, late)
