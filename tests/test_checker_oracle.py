"""The checker's fast paths (issue 42) agree, violation for violation, with the checker as it was written
before them: every clock recomputed from scratch, every VW's gap after every push, every ``glob`` entry walked,
every field's type tested one by one and every task that ran kept in a set. The oracle below is that code;
random schedules with random planted faults must get the same list of violations from both."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe_jax.core import check, trace, wsp

from helpers import schedule_only

CASES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _c_global(clock: wsp.ClockState) -> int:
  """The global clock recomputed from every clock (the oracle does not trust ``ClockState.low``)."""
  live = [c for i, c in enumerate(clock.c_local) if i not in clock.left]
  return min(live) if live else min(clock.c_local)


class _Tasks(set):
  """The tasks that ran as a plain set of every one (what ``check._Done`` answers in bounded memory)."""

  def forget(self, vw: int) -> None:
    self.difference_update([key for key in self if key[1] == vw])

  def seen(self, key) -> bool:
    there = key in self
    self.add(key)
    return there


class _Oracle(check._Checker):
  """The checker without its fast paths."""

  def __init__(self, meta):
    super().__init__(meta)
    self.done = _Tasks()

  def _fast_task(self, ev, kind) -> bool:  # every task rule by rule
    return False

  def _fast_mark(self, ev, kind) -> bool:  # every injection and completion rule by rule
    return False

  def _latest(self, ev):  # every time in order, without the fast path of a task's two
    times = [ev[f] for f in ("t", "t0", "t1") if f in ev]
    if any(x < y - check.EPS for x, y in zip(times[1:], times)):
      self.fail("time", f"{ev['ev']} ends before it starts: {times}")
    return max(times) if times else None

  def _on_inject(self, ev) -> None:
    self.clock = self.clock._replace(low=_c_global(self.clock))  # the gate's gap from scratch
    super()._on_inject(ev)

  def _ahead_after_push(self, i: int) -> None:
    for k in (k for k in range(self.n) if k not in self.clock.left):
      gap = self.clock.c_local[k] - _c_global(self.clock)
      if gap > self.d + 1:
        self.fail("gate", f"VW {k} runs {gap} waves ahead of the slowest (clocks "
                  f"{list(self.clock.c_local)}); WSP allows D + 1 = {self.d + 1}")

  def _check_global(self, i: int, j: int, p: int, glob: tuple, what: str) -> None:
    if len(glob) != self.n:
      return self.fail("format", f"{what}: glob has {len(glob)} entries for {self.n} virtual workers")
    self._check_global_bounds(i, j, p, glob, what, wsp.min_global_waves(p, self.nm[i], self.d))
    if glob not in self.pulls[i]:
      self.fail("global", f"{what} of VW {i} minibatch {p} at stage {j} has global base {list(glob)}, "
                f"which VW {i} never pulled")

  def _on_pull(self, ev) -> None:
    i, glob = ev["vw"], tuple(ev["glob"])
    if i in self.clock.left:
      return self.fail("member", f"pull of VW {i}, which left and has not joined again")
    self.joining.discard(i)
    if len(glob) != self.n:
      return self.fail("format", f"pull of VW {i}: glob has {len(glob)} entries for {self.n} VWs")
    for k, g in enumerate(glob):
      if g > self.clock.c_local[k]:
        self.fail("global", f"VW {i} pulled {g} waves of VW {k}, which had pushed {self.clock.c_local[k]}")
    global_clock = min(g for k, g in enumerate(glob) if k not in self.clock.left)
    if self.clock.c_local[i] - global_clock > self.d:
      self.fail("gate", f"VW {i} pulled at clock {self.clock.c_local[i]} with global clock {global_clock}; "
                f"the gate allows D = {self.d}")
    self.pulls[i].add(glob)
    self.pulled_since_push[i] = True


def oracle(events: list[dict]) -> list[check.Violation]:
  """The violations the checker without fast paths finds (its field types tested one by one as well) in a trace
  of version 1 (``check.as_version_1`` writes one of version 2 so)."""
  events = list(events)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(trace, "_sound", lambda event: False)
    bad = check._meta_violation(events[0]) if events else check.Violation(1, "format", "the first line must be "
                                                                             "the meta event")
    if bad is not None:
      return [bad]
    checker = _Oracle(events[0])
    for line, ev in enumerate(events[1:], start=2):
      checker.line = line
      checker.event(ev)
    checker.line = len(events)
    checker.finish()
  return checker.violations


def _bump(rng: random.Random, ev: dict, field: str) -> None:
  if isinstance(ev.get(field), list) and ev[field]:
    k = rng.randrange(len(ev[field]))
    ev[field] = [g + rng.choice((-1, 1)) if n == k else g for n, g in enumerate(ev[field])]
  elif isinstance(ev.get(field), int):
    ev[field] += rng.choice((-1, 1))


def plant(rng: random.Random, events: list[dict], n: int) -> None:
  """Plants one random fault in ``events`` (a schedule of ``n`` VWs) in place."""
  at = rng.randrange(1, len(events))
  fault = rng.choice(["delete", "swap", "repeat", "glob", "own", "wave", "mb", "type", "leave", "join", "clock"])
  ev = events[at] = dict(events[at])
  if fault == "delete":
    del events[at]
  elif fault == "swap" and at + 1 < len(events):
    events[at], events[at + 1] = events[at + 1], events[at]
  elif fault == "repeat":
    events.insert(at, dict(ev))
  elif fault in ("glob", "own", "wave", "mb"):
    _bump(rng, ev, fault)
  elif fault == "type":
    field = rng.choice([f for f in ev if f != "ev"])
    ev[field] = rng.choice([True, "1", 1.5, None, [True]])
  elif fault == "leave":
    events.insert(at, {"ev": "leave", "vw": rng.randrange(n), "t": ev.get("t", ev.get("t0", 0))})
  elif fault == "join":
    events.insert(at, {"ev": "join", "vw": rng.randrange(n), "t": ev.get("t", ev.get("t0", 0)),
                       "clock": rng.randrange(4)})
  else:  # a VW's pushes jump ahead: the gate after a push, and the join's recount, see it
    events.insert(at, {"ev": "push", "vw": rng.randrange(n), "wave": rng.randrange(6), "t": ev.get("t", 0)})


@st.composite
def schedules(draw) -> tuple[list[dict], int]:
  """A random schedule (1-4 VWs, 1-3 stages, Nm 1-3, D 0-2, random speeds) with 0-4 planted faults."""
  n = draw(st.integers(1, 4))
  stages = [draw(st.integers(1, 3)) for _ in range(n)]
  nms = [draw(st.integers(1, 3)) for _ in range(n)]
  slow = [draw(st.sampled_from([1.0, 1.5, 2.0, 3.5])) for _ in range(n)]
  events = schedule_only(stages, nms, d=draw(st.integers(0, 2)), waves=draw(st.integers(2, 5)), slowdown=slow)
  rng = random.Random(draw(st.integers(0, 2**32 - 1)))
  for _ in range(draw(st.integers(0, 4))):
    plant(rng, events, n)
  return events, n


@CASES
@given(case=schedules())
def test_the_checker_agrees_with_its_oracle_violation_for_violation(case):
  events, _ = case
  assert check.check_trace(events) == oracle(events)


def test_the_oracle_finds_what_is_planted():
  """The comparison means something: a planted gate breach is found by both, at the same lines."""
  events = schedule_only([1, 1, 1], [1, 1, 1], d=0, waves=3, slowdown=[1.0, 1.0, 1.0])
  assert check.check_trace(events) == oracle(events) == []
  at = next(n for n, e in enumerate(events) if e.get("ev") == "push")
  events[at + 1:at + 1] = [{"ev": "push", "vw": 2, "wave": w, "t": events[at]["t"]} for w in range(1, 3)]
  found = check.check_trace(events)
  assert found == oracle(events)
  assert any(v.rule == "gate" and "ahead of the slowest" in v.message for v in found)


# --- trace version 2: global bases named by seq --------------------------------------------------------

@st.composite
def both_versions(draw) -> tuple[list[dict], list[dict], int]:
  """One random schedule written in version 1 and in version 2 (the same run: the engine is deterministic)."""
  n = draw(st.integers(1, 4))
  args = dict(stages=[draw(st.integers(1, 3)) for _ in range(n)], nms=[draw(st.integers(1, 3)) for _ in range(n)],
              d=draw(st.integers(0, 2)), waves=draw(st.integers(2, 5)),
              slowdown=[draw(st.sampled_from([1.0, 1.5, 2.0, 3.5])) for _ in range(n)],
              weight_mode=draw(st.sampled_from(["stash", "stash", "latest"])))
  return schedule_only(**args), schedule_only(**args, version=2), draw(st.integers(0, 2**32 - 1))


@CASES
@given(case=both_versions())
def test_a_version_2_trace_written_in_version_1_is_todays_trace_event_for_event(case):
  v1, v2, _ = case
  assert v2[0]["version"] == 2 and all("glob" not in e for e in v2)
  assert list(check.as_version_1(v2)) == v1
  assert check.check_trace(v2) == check.check_trace(v1)


@CASES
@given(case=both_versions())
def test_the_version_2_checker_agrees_with_version_1_on_planted_faults(case):
  """A version-2 trace with planted faults (a seq moved as well) gets the violations of its version-1 form."""
  _, v2, seed = case
  rng = random.Random(seed)
  n = v2[0]["num_vws"]
  for _ in range(rng.randrange(1, 4)):
    if rng.random() < 0.3:  # a task or pull names another global base
      at = rng.choice([k for k, e in enumerate(v2) if "seq" in e])
      v2[at] = {**v2[at], "seq": max(0, v2[at]["seq"] + rng.choice((-2, -1, 1)))}
    else:
      plant(rng, v2, n)
  try:
    v1 = list(check.as_version_1(v2))
  except check.ConfigError:  # a seq beyond the changes made before it: no clocks to write, and a violation
    assert check.check_trace(v2)
    return
  assert check.check_trace(v2) == check.check_trace(v1) == oracle(v1)


def test_a_sound_version_2_trace_takes_the_fast_path_at_every_task_but_a_devices_first():
  """The comparisons above test the fast path (``_Checker._fast_task``): a sound trace's tasks all take it, but the
  first task on each device (its record is made rule by rule)."""
  v2 = schedule_only([2, 3, 1], [2, 3, 1], d=1, waves=4, slowdown=[1.0, 2.0, 1.5], version=2)
  checker = check._Checker(v2[0])
  fast, devices = 0, set()
  for line, ev in enumerate(v2[1:], start=2):
    checker.line = line
    if ev["ev"] in ("fwd", "bwd") and checker._fast_task(ev, ev["ev"]):
      fast += 1
      assert (ev["vw"], ev["stage"]) in devices
      continue
    if ev["ev"] in ("fwd", "bwd"):
      assert (ev["vw"], ev["stage"]) not in devices, f"line {line}: {ev} left the fast path"
      devices.add((ev["vw"], ev["stage"]))
    checker.event(ev)
  checker.finish()
  assert fast > 3 * len(devices) and checker.violations == []


@pytest.mark.parametrize("version", [1, 2])
def test_a_sound_traces_injections_but_gated_ones_and_its_completions_take_the_fast_path(version):
  """``_Checker._fast_mark`` takes every injection that passes no gate and every completion of a sound trace."""
  events = schedule_only([2, 3, 1], [2, 3, 1], d=1, waves=4, slowdown=[1.0, 2.0, 1.5], version=version)
  checker = check._Checker(events[0])
  fast = 0
  for line, ev in enumerate(events[1:], start=2):
    checker.line = line
    if ev["ev"] in ("inject", "complete"):
      gated = ev["ev"] == "inject" and wsp.is_gated(ev["mb"], checker.nm[ev["vw"]])
      taken = checker._fast_mark(ev, ev["ev"])
      assert taken != gated, f"line {line}: {ev}"
      fast += taken
      if taken:
        continue
    checker.event(ev)
  checker.finish()
  assert fast > 30 and checker.violations == []


def test_an_injection_of_a_vw_that_joined_and_has_not_pulled_leaves_the_fast_path():
  events = schedule_only([2, 2], [3, 3], d=1, waves=3, slowdown=[1.0, 1.5])
  at = next(k for k, e in enumerate(events) if e["ev"] == "inject" and e["vw"] == 0 and e["mb"] == 4)
  t = events[at]["t"]  # (joined at clock 1, it runs from minibatch 4 on: the injection is the next one)
  events[at:at] = [{"ev": "leave", "vw": 0, "t": t}, {"ev": "join", "vw": 0, "t": t, "clock": 1}]
  got = check.check_trace(events)
  assert got == oracle(events)
  assert any(v.rule == "member" and v.line == at + 3 and "injection of minibatch 4 of VW 0, which joined" in v.message
             for v in got)


def test_a_task_repeated_at_once_on_a_free_device_is_caught_on_the_fast_path_too():
  """A forward repeated right after itself, taking no time (its device free, its weights unchanged): only the
  books of the tasks that ran tell it ran twice; the fast path must hand it to the rule-by-rule path."""
  v2 = schedule_only([2, 3, 1], [2, 3, 1], d=1, waves=4, slowdown=[1.0, 2.0, 1.5], version=2)
  fwds = [k for k, e in enumerate(v2) if e["ev"] == "fwd" and e["mb"] > 2]
  at = fwds[len(fwds) // 2]
  v2.insert(at + 1, {**v2[at], "t0": v2[at]["t1"]})
  got = check.check_trace(v2)
  assert got == oracle(list(check.as_version_1(v2)))
  assert [v.rule for v in got] == ["order"] and "ran twice" in got[0].message and got[0].line == at + 2
