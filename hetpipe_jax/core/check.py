"""Checks a trace against every guarantee of WSP (docs/PROTOCOL.md sections 3.7 and 9).

Replays the events in file order (= causal order) and reports each broken rule with its line number:

==========  ===================================================================================
rule        what it asserts
==========  ===================================================================================
format      a meta line first; known events; virtual worker, stage and minibatch in range
time        event times never go back (on each process's own clock, where events name their
            ``process``); a task ends after it starts
order       in-order injection within the Nm window; a task only after its predecessor; no task twice;
            in-order completion after the stage-0 backward
device      one task at a time per device
local       a forward of p includes own updates 1 .. p - Nm (local staleness <= Nm - 1); under accumulation over
            k minibatches (meta ``accumulate``), the groups of k that end by p - Nm
rebase      a task's weights hold exactly the updates its stage has applied (none lost, none twice)
global      the weights of p include every VW's waves 0 .. w-D-2 (0 .. w-D-1 for a wave's last
            minibatch) and nothing not yet pushed; they come from a real pull, never going back
gate        a gated injection passes c_local - c_global <= D after a pull; c_local - c_global <= D+1
push        each wave pushed once, in clock order, after it completed, to every shard; skipped
            updates (fp16 loss-scale overflows) only in an fp16 run, 1 .. stages x Nm per wave
stash       in stash mode a backward uses its forward's weight version
member      a VW that left runs nothing until it joins; it joins at the global clock of the live
            VWs and pulls first (the rules above then hold over the live VWs; a VW that left
            counts with at most the waves it pushed)
end         every injected minibatch completed and every finished wave pushed (live VWs)
applied     where copies of the PS shards report what they applied (a multi-process run's ``applied``
            lines), each applied exactly the waves pushed, and every unit has such a copy
==========  ===================================================================================

CLI: ``python -m hetpipe_jax.check TRACE`` prints the violations (exit 1) or "OK" and the observed
staleness (exit 0).
"""

from __future__ import annotations

import bisect
import json
import math
import operator
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, cast

from hetpipe_jax.core import wsp
from hetpipe_jax.core.controls import min_own, updates_at
from hetpipe_jax.core.meta import VERSIONS
from hetpipe_jax.core.trace import field_error, staleness_stats, trace_cli, write_trace
from hetpipe_jax.errors import ConfigError, ProtocolError

EPS = 1e-9
_TIME_TYPES = (int, float)  # a time's exact types on the fast path (a subclass takes the rule-by-rule path)


class Violation(NamedTuple):
  line: int  # 1-based line of the trace
  rule: str
  message: str

  def __str__(self) -> str:
    return f"line {self.line}: [{self.rule}] {self.message}"


class _Device:
  """What the checker knows of one stage of one VW, in one record: a task reads one object, where books keyed by
  tuples (one dict per kind of fact) spread a task's reads over memory that outgrows the caches at scale."""

  __slots__ = ("free_at", "applied", "last_glob", "forwards", "fwd", "bwd")

  def __init__(self):
    self.free_at: float | None = None  # the end of its latest task
    self.applied = 0  # backward passes applied
    self.last_glob: tuple | int | None = None  # the global base of its latest forward
    self.forwards: dict[int, tuple] = {}  # mb -> (own, global base) of each forward whose backward has not run
    # the forwards and the backwards that ran, each as [first, last, {others}] (see :class:`_Done`), None before one
    # (two fields, not a dict by kind: one object fewer read per task)
    self.fwd: list | None = None
    self.bwd: list | None = None

  def run(self, kind: str) -> list | None:
    """The tasks of ``kind`` ("fwd" or "bwd") that ran (:class:`_Done`)."""
    return self.fwd if kind == "fwd" else self.bwd


def _device(devices: list[dict[int, _Device]], i: int, j: int) -> _Device:
  """VW ``i``'s stage ``j``'s record, made on first use (a meta line's stage counts are not trusted to allocate)."""
  d = devices[i].get(j)
  if d is None:
    d = devices[i][j] = _Device()
  return d


def _ran(run: list | None, p: int) -> bool:
  """Whether minibatch ``p`` is in ``run`` (:class:`_Done`)."""
  return run is not None and (run[0] <= p <= run[1] or p in run[2])


def _add(d: _Device, kind: str, p: int) -> bool:
  """Whether minibatch ``p``'s task of ``kind`` ran on ``d`` already; it has, after."""
  run = d.run(kind)
  if run is None:
    if kind == "fwd":
      d.fwd = [p, p, set()]
    else:
      d.bwd = [p, p, set()]
    return False
  if p == run[1] + 1:  # (the common case: the next minibatch)
    run[1] = p
    while run[1] + 1 in run[2]:  # a gap closed: what was ahead of it joins the interval
      run[1] += 1
      run[2].discard(run[1])
    return False
  if run[0] <= p <= run[1] or p in run[2]:
    return True
  run[2].add(p)
  return False


class _Done:
  """The tasks that ran, (kind, vw, stage, mb), as a set answers of them, in memory that does not grow with the run:
  per device (its record's ``fwd`` and ``bwd``) and kind, the interval of minibatches that ran without a gap and the few
  others (those ahead of a gap), where a set of every task would hold millions at scale."""

  def __init__(self, devices: list[dict[int, _Device]]):
    self._devices = devices

  def __contains__(self, key: tuple[str, int, int, int]) -> bool:
    kind, i, j, p = key
    d = self._devices[i].get(j)
    return d is not None and _ran(d.run(kind), p)

  def seen(self, key: tuple[str, int, int, int]) -> bool:
    """Whether ``key`` is here already; it is, after."""
    kind, i, j, p = key
    return _add(_device(self._devices, i, j), kind, p)

  def forget(self, vw: int) -> None:
    """Every task of ``vw`` (it joined again: its books restart)."""
    for d in self._devices[vw].values():
      d.fwd = d.bwd = None


class _Checker:
  """Replays a trace; every ``_on_<event>`` method checks one event against the state so far."""

  def __init__(self, meta: dict[str, Any]):
    self.n, self.nm, self.d = meta["num_vws"], meta["nm"], meta["d"]
    self.window = meta.get("window") or self.nm  # most in flight: a window below Nm where one is set
    self.k, self.stash = meta["stages"], meta["weight_mode"] == "stash"
    self.acc = meta.get("accumulate") or [1] * self.n  # minibatches per local update (controls: 2bw)
    if any(k != 1 for k in self.acc):  # the fast path inlines one update per minibatch: these go rule by rule
      self._fast_task = self._no_fast_task
    self.shards = meta.get("shards")
    self.precision = meta.get("precision", "fp32")
    self.violations: list[Violation] = []
    self.line = 1
    self.clock = wsp.init(self.n)
    self.injected = [0] * self.n
    self.completed = [0] * self.n
    self.devices: list[dict[int, _Device]] = [{} for _ in range(self.n)]  # per VW: stage -> its record
    self.done = _Done(self.devices)  # (kind, vw, stage, mb) of the tasks that ran
    # A trace of version 2 names a global base by its seq (the clocks after that many changes); while no VW has
    # left or joined, seqs are compared as they are (a seq's clocks are then told by the global clock after it:
    # ``lows``); after, every seq is turned into its clocks and checked as version 1's glob.
    self.by_seq = meta.get("version") == 2
    self.changes = [([0], [0]) for _ in range(self.n)] if self.by_seq else []  # per VW: (seqs, its clock then)
    self.lows = [0]  # the global clock after each number of clock changes (version 2, while by_seq)
    start: tuple | int = 0 if self.by_seq else (0,) * self.n
    self.pulls: list[set[tuple | int]] = [{start} for _ in range(self.n)]  # the global bases each VW pulled
    self.pulled_since_push = [False] * self.n
    self.t: dict[int | None, float] = {}  # the latest time on each process's clock (None: one process)
    self.joining: set[int] = set()  # joined, not pulled yet
    self.ahead: set[int] = set()  # holds every live VW beyond D + 1 of the global clock (maybe others)
    self.applied_lines: list[tuple[int, int, int, list[int], int]] = []  # (line, vw, owner, units, waves)
    self._handlers = {name[4:]: getattr(self, name) for name in dir(self) if name.startswith("_on_")}  # kind: method

  def fail(self, rule: str, message: str) -> None:
    self.violations.append(Violation(self.line, rule, message))

  def event(self, ev: dict[str, Any]) -> None:
    kind = ev.get("ev")
    if kind == "fwd" or kind == "bwd":
      if self.by_seq and self._fast_task(ev, kind):
        return
    elif (kind == "inject" or kind == "complete") and self._fast_mark(ev, kind):
      return
    handler = self._handlers.get(kind) if isinstance(kind, str) else None
    if handler is None:
      return  # extra event kinds are allowed
    if (error := field_error(ev)) is not None:
      return self.fail("format", error)
    try:
      if not 0 <= ev["vw"] < self.n:
        return self.fail("format", f"virtual worker {ev['vw']} out of range 0..{self.n - 1}")
      latest = self._latest(ev)
      if latest is None:
        return self.fail("format", f"{ev['ev']} event has no time (t, or t0 and t1)")
      clock = ev.get("process")  # a multi-process trace: each process's own clock, never compared across
      last = self.t.get(clock, 0.0 if clock is None else -math.inf)  # (a process's clock may start below 0)
      if latest < last - EPS:
        where = "" if clock is None else f" of process {clock}"
        self.fail("time", f"{ev['ev']} at t={latest} after an event{where} at t={last}")
      self.t[clock] = max(last, latest)
      handler(ev)
    except KeyError as e:
      self.fail("format", f"{ev.get('ev')} event lacks field {e}")

  def _latest(self, ev: dict[str, Any]) -> float | None:
    """The latest of an event's times (t, t0, t1), or None without one; times out of order are a violation."""
    if "t0" in ev and "t1" in ev and "t" not in ev:  # (a task or a wait: most events)
      t0, t1 = ev["t0"], ev["t1"]
      if t1 < t0 - EPS:
        self.fail("time", f"{ev['ev']} ends before it starts: {[t0, t1]}")
      return t0 if t0 >= t1 else t1
    times = [ev[f] for f in ("t", "t0", "t1") if f in ev]
    if any(x < y - EPS for x, y in zip(times[1:], times)):
      self.fail("time", f"{ev['ev']} ends before it starts: {times}")
    return max(times) if times else None

  # --- the fast path: a sound task of a version-2 trace (most events at scale) -------------------------

  def _no_fast_task(self, ev: dict[str, Any], kind: str) -> bool:
    """:meth:`_fast_task` of a trace with accumulation over k minibatches: never taken (:meth:`_on_fwd` and
    :meth:`_on_bwd` read each virtual worker's k; the fast path's one update per minibatch costs no lookup)."""
    return False

  def _fast_task(self, ev: dict[str, Any], kind: str) -> bool:
    """Whether ``ev``, a forward or backward of a version-2 trace while no VW has left or joined, with exactly its
    fields and their types, on a device that ran a task before, breaks no rule: then its state is recorded as
    :meth:`event` would, in one call. False changes nothing, and :meth:`event` takes it rule by rule (what breaks,
    and every message, are told only there)."""
    if len(ev) != 8:
      return False
    try:
      i, j, p, t0, t1, own, seq = ev["vw"], ev["stage"], ev["mb"], ev["t0"], ev["t1"], ev["own"], ev["seq"]
    except KeyError:
      return False
    if not (type(i) is int and type(j) is int and type(p) is int and type(own) is int and type(seq) is int
            and type(t0) in _TIME_TYPES and type(t1) in _TIME_TYPES and 0 <= i < self.n and t1 >= t0 - EPS):
      return False
    latest, last = (t0 if t0 >= t1 else t1), self.t.get(None, 0.0)
    if latest < last - EPS or not (0 <= j < self.k[i] and 1 <= p <= self.injected[i]):
      return False
    devs = self.devices[i]
    d = devs.get(j)
    if d is None or d.free_at is None or t0 < d.free_at - EPS:
      return False
    run = d.fwd if kind == "fwd" else d.bwd  # (:meth:`_Device.run`, inline)
    if run is not None and p != run[1] + 1:
      return False
    # the task before it: a forward's at the stage before (none at stage 0); a backward's at the stage after, or
    # the last stage's forward (:meth:`_on_fwd`, :meth:`_on_bwd`)
    last_stage = j == self.k[i] - 1
    if kind == "bwd" or j:
      prior = devs.get(j - 1) if kind == "fwd" else d if last_stage else devs.get(j + 1)
      before = None if prior is None else prior.bwd if kind == "bwd" and not last_stage else prior.fwd
      if before is None or not (before[0] <= p <= before[1] or p in before[2]):  # (:func:`_ran`, inline)
        return False
    if not (self._fast_fwd(d, i, p, own, seq) if kind == "fwd" else self._fast_bwd(d, i, p, own, seq)):
      return False
    if run is None or run[2]:  # (the first, or the next minibatch: recorded, not seen before)
      _add(d, kind, p)
    else:  # (:func:`_add`, inline)
      run[1] = p
    d.free_at = t1 if t1 > d.free_at else d.free_at
    self.t[None] = max(last, latest)
    return True

  def _fast_mark(self, ev: dict[str, Any], kind: str) -> bool:
    """Whether ``ev``, an injection that passes no gate or a completion (a third of the events), with exactly its
    fields and their types, breaks no rule: then recorded as :meth:`event` would. False changes nothing, as for
    :meth:`_fast_task`."""
    if len(ev) != 4:
      return False
    try:
      i, p, t = ev["vw"], ev["mb"], ev["t"]
    except KeyError:
      return False
    if not (type(i) is int and type(p) is int and type(t) in _TIME_TYPES and 0 <= i < self.n):
      return False
    last = self.t.get(None, 0.0)
    if t < last - EPS:
      return False
    if kind == "inject":  # (:meth:`_on_inject`)
      if p != self.injected[i] + 1 or p - self.window[i] > self.completed[i] or wsp.is_gated(p, self.nm[i]) \
          or i in self.clock.left or i in self.joining:
        return False
      self.injected[i] = p
    else:  # (:meth:`_on_complete`: the next minibatch, its backward at stage 0 ran)
      d = self.devices[i].get(0)
      if p != self.completed[i] + 1 or d is None or not _ran(d.bwd, p):
        return False
      self.completed[i] = p
    self.t[None] = t if t > last else last
    return True

  def _fast_global(self, i: int, p: int, seq: int) -> bool:
    """:meth:`_check_global_seq` finds nothing (the seq reached, its clocks enough, pulled by VW ``i``)."""
    nm = self.nm[i]  # (:func:`wsp.min_global_waves`, inline: its max with 0 changes nothing, the clocks being >= 0)
    need = (p - 1) // nm - self.d - (p % nm != 0)
    return 0 <= seq <= self.clock.seq and self.lows[seq] >= need and seq in self.pulls[i]

  def _fast_fwd(self, d: _Device, i: int, p: int, own: int, seq: int) -> bool:
    """:meth:`_on_fwd`'s rules past :meth:`_task` hold: recorded."""
    if own < p - self.nm[i] or own != d.applied or not self._fast_global(i, p, seq) \
        or (d.last_glob is not None and seq < cast(int, d.last_glob)):  # (a seq: no VW has left or joined)
      return False
    d.forwards[p] = (own, seq)
    d.last_glob = seq
    return True

  def _fast_bwd(self, d: _Device, i: int, p: int, own: int, seq: int) -> bool:
    """:meth:`_on_bwd`'s rules past :meth:`_task` hold: recorded."""
    if self.stash:
      fwd = d.forwards.get(p)
      if fwd is not None and fwd != (own, seq):
        return False
    elif own != d.applied or not self._fast_global(i, p, seq):
      return False
    d.forwards.pop(p, None)
    d.applied += 1
    return True

  # --- minibatch flow --------------------------------------------------------------------------------

  def _gone(self, i: int, what: Callable[[], str]) -> bool:
    """Whether VW ``i`` has left (a violation: ``what()`` happened anyway; told only then)."""
    if i in self.clock.left or i in self.joining:
      self.fail("member", f"{what()} of VW {i}, which " + ("left and has not joined again" if i in self.clock.left
                                                          else "joined and has not pulled yet"))
      return True
    return False

  def _on_inject(self, ev) -> None:
    i, p = ev["vw"], ev["mb"]
    if self._gone(i, lambda: f"injection of minibatch {p}"):
      return
    nm, window = self.nm[i], self.window[i]
    if p != self.injected[i] + 1:
      self.fail("order", f"VW {i} injected minibatch {p} after {self.injected[i]} (in order only)")
    if p - window > self.completed[i]:
      what = f"Nm={nm}" if window == nm else f"window={window}, Nm={nm}"
      self.fail("order", f"VW {i} injected minibatch {p} before minibatch {p - window} completed "
                f"({what} in flight; {self.completed[i]} completed)")
    if wsp.is_gated(p, nm):
      gap = wsp.clock_gap(self.clock, i)
      if gap > self.d:
        self.fail("gate", f"VW {i} injected gated minibatch {p} at c_local - c_global = {gap} > D = "
                  f"{self.d} (clocks {list(self.clock.c_local)})")
      if not self.pulled_since_push[i]:
        self.fail("gate", f"VW {i} injected gated minibatch {p} without pulling after its last push")
    self.injected[i] = max(self.injected[i], p)

  def _task(self, ev) -> tuple[int, int, int, tuple] | None:
    i, j, p = ev["vw"], ev["stage"], ev["mb"]
    if self._gone(i, lambda: f"{ev['ev']} of minibatch {p} at stage {j}"):
      return None
    if not 0 <= j < self.k[i] or not 1 <= p <= self.injected[i]:
      self.fail("format" if not 0 <= j < self.k[i] else "order",
                f"{ev['ev']} of VW {i} stage {j} minibatch {p}: stage out of range or minibatch not "
                "injected")
      return None
    if self.done.seen((ev["ev"], i, j, p)):
      self.fail("order", f"{ev['ev']} of VW {i} stage {j} minibatch {p} ran twice")
    d = _device(self.devices, i, j)
    free = d.free_at if d.free_at is not None else 0.0 if ev.get("process") is None else -math.inf
    if ev["t0"] < free - EPS:  # (a first task before 0 on one process's clock too)
      self.fail("device", f"VW {i} stage {j} started {ev['ev']} of minibatch {p} at {ev['t0']} while "
                f"busy until {free}")
    d.free_at = max(-math.inf if d.free_at is None else d.free_at, ev["t1"])
    return i, j, p, (ev["own"], self._base(ev))

  # --- version 2: global bases named by seq -------------------------------------------------------------

  def _base(self, ev) -> tuple | int:
    """The global base an event names: its glob (version 1), its seq (version 2 while ``by_seq``), or the
    clocks of its seq (version 2 after a VW left or joined)."""
    if not self.changes:
      return tuple(ev["glob"])
    seq = ev["seq"]
    return seq if self.by_seq else self._glob(seq)

  def _glob(self, base: tuple | int) -> tuple:
    """The clocks of a global base (a seq's: every VW's clock after that many changes; O(N log changes))."""
    if isinstance(base, tuple):
      return base
    return tuple(clocks[bisect.bisect_right(seqs, base) - 1] for seqs, clocks in self.changes)

  def _unknown(self, base: tuple | int, what: str) -> bool:
    """Whether ``base`` is a seq no change has reached yet (a violation: its clocks are not known)."""
    if isinstance(base, tuple) or 0 <= base <= self.clock.seq:
      return False
    self.fail("global", f"{what} names the global base after {base} clock changes; {self.clock.seq} were made")
    return True

  def _changed(self, i: int) -> None:
    """VW ``i``'s clock changed (a push or a join): its change and the global clock after it are recorded."""
    if self.changes:
      seqs, clocks = self.changes[i]
      seqs.append(self.clock.seq)
      clocks.append(self.clock.c_local[i])
      if self.by_seq:
        self.lows.append(self.clock.low)

  def _to_clocks(self) -> None:
    """A VW leaves or joins: from now on every seq is checked as the clocks it names."""
    if not self.by_seq:
      return
    self.by_seq = False
    self.pulls = [{self._glob(s) for s in pulled} for pulled in self.pulls]
    for d in (d for devs in self.devices for d in devs.values()):
      d.last_glob = None if d.last_glob is None else self._glob(d.last_glob)
      d.forwards = {p: (own, self._glob(s)) for p, (own, s) in d.forwards.items()}

  def _check_global(self, i: int, j: int, p: int, glob: tuple | int, what: str) -> None:
    if self._unknown(glob, f"{what} of VW {i} minibatch {p} at stage {j}"):
      return
    if isinstance(glob, int):
      return self._check_global_seq(i, j, p, glob, what)
    if len(glob) != self.n:
      return self.fail("format", f"{what}: glob has {len(glob)} entries for {self.n} virtual workers")
    need_live = wsp.min_global_waves(p, self.nm[i], self.d)
    if self.clock.left or min(glob) < need_live or any(map(operator.gt, glob, self.clock.c_local)):
      self._check_global_bounds(i, j, p, glob, what, need_live)  # (entry by entry: what breaks, in order)
    if glob not in self.pulls[i]:
      self.fail("global", f"{what} of VW {i} minibatch {p} at stage {j} has global base {list(glob)}, "
                f"which VW {i} never pulled")

  def _check_global_seq(self, i: int, j: int, p: int, seq: int, what: str) -> None:
    """:meth:`_check_global` of a seq, while no VW has left or joined: O(1)."""
    need_live = wsp.min_global_waves(p, self.nm[i], self.d)
    if self.lows[seq] < need_live:
      self._check_global_bounds(i, j, p, self._glob(seq), what, need_live)
    if seq not in self.pulls[i]:
      self.fail("global", f"{what} of VW {i} minibatch {p} at stage {j} has global base {list(self._glob(seq))}, "
                f"which VW {i} never pulled")

  def _check_global_bounds(self, i: int, j: int, p: int, glob: tuple, what: str, need_live: int) -> None:
    for k, g in enumerate(glob):
      need = min(need_live, self.clock.c_local[k]) if k in self.clock.left else need_live
      if g < need:
        self.fail("global", f"{what} of VW {i} minibatch {p} (wave {wsp.wave_of(p, self.nm[i])}) at stage "
                  f"{j} includes {g} waves of VW {k}; WSP with D={self.d} needs >= {need}")
      if g > self.clock.c_local[k]:
        self.fail("global", f"{what} of VW {i} minibatch {p} at stage {j} includes {g} waves of VW {k}, "
                  f"which had pushed only {self.clock.c_local[k]}")

  def _on_fwd(self, ev) -> None:
    task = self._task(ev)
    if task is None:
      return
    i, j, p, (own, glob) = task
    d = self.devices[i][j]
    if j > 0 and ("fwd", i, j - 1, p) not in self.done:
      self.fail("order", f"forward of VW {i} minibatch {p} at stage {j} before stage {j - 1}")
    k = self.acc[i]
    need = p - self.nm[i] if k == 1 else min_own(p, self.nm[i], k)  # (one call fewer a task in the common case)
    if own < need:
      per = f", one update per {k} minibatches" if k > 1 else ""
      self.fail("local", f"forward of VW {i} minibatch {p} at stage {j} includes {own} own updates; "
                f"needs >= {need} (Nm={self.nm[i]}{per})")
    if own != d.applied:
      self.fail("rebase", f"forward of VW {i} minibatch {p} at stage {j} uses weights with {own} own "
                f"updates, but the stage has applied {d.applied} (lost or double-counted "
                "local updates)")
    self._check_global(i, j, p, glob, "forward")
    d.forwards[p] = (own, glob)
    if isinstance(glob, int) and not 0 <= glob <= self.clock.seq:
      return  # (a seq not reached yet: reported)
    last = d.last_glob if d.last_glob is not None else 0 if isinstance(glob, int) else (0,) * self.n
    if isinstance(glob, int) and isinstance(last, int):  # (no VW left or joined: a later seq holds more clocks)
      older = glob < last
    else:
      older = any(map(operator.lt, self._glob(glob), self._glob(last)))
    if older:
      self.fail("global", f"forward of VW {i} minibatch {p} at stage {j} has global base {list(self._glob(glob))}, "
                f"older than an earlier forward's {list(self._glob(last))}")
    d.last_glob = glob

  def _on_bwd(self, ev) -> None:
    task = self._task(ev)
    if task is None:
      return
    i, j, p, version = task
    d = self.devices[i][j]
    before = ("fwd", i, j, p) if j == self.k[i] - 1 else ("bwd", i, j + 1, p)
    if before not in self.done:
      self.fail("order", f"backward of VW {i} minibatch {p} at stage {j} before {before[0]} at stage "
                f"{before[2]}")
    fwd = d.forwards.pop(p, None)
    if self.stash and fwd is not None and version != fwd:
      self.fail("stash", f"backward of VW {i} minibatch {p} at stage {j} used weights (own, glob) = "
                f"{version[0]}, {list(self._glob(version[1]))} but its forward used {fwd[0]}, "
                f"{list(self._glob(fwd[1]))}")
    if not self.stash:
      if version[0] != d.applied:
        self.fail("rebase", f"backward of VW {i} minibatch {p} at stage {j} uses weights with "
                  f"{version[0]} own updates, but the stage has applied {d.applied}")
      self._check_global(i, j, p, version[1], "backward")
    k = self.acc[i]
    d.applied += 1 if k == 1 else updates_at(p, k)

  def _on_complete(self, ev) -> None:
    i, p = ev["vw"], ev["mb"]
    if p != self.completed[i] + 1:
      self.fail("order", f"VW {i} completed minibatch {p} after {self.completed[i]} (in order only)")
    if ("bwd", i, 0, p) not in self.done:
      self.fail("order", f"VW {i} completed minibatch {p} before its backward at stage 0")
    self.completed[i] = max(self.completed[i], p)

  # --- WSP -------------------------------------------------------------------------------------------

  def _on_push(self, ev) -> None:
    i, c = ev["vw"], ev["wave"]
    if c != self.clock.c_local[i]:
      self.fail("push", f"VW {i} pushed wave {c} but had pushed {self.clock.c_local[i]} waves (each wave "
                "once, in clock order)")
    if self.completed[i] < (c + 1) * self.nm[i] and ev.get("history") != "lost":  # (lost: died with a process)
      self.fail("push", f"VW {i} pushed wave {c} with {self.completed[i]} minibatches completed; the "
                f"wave ends at minibatch {(c + 1) * self.nm[i]}")
    if self.shards is not None and ev.get("shards") != self.shards:
      self.fail("push", f"VW {i} pushed wave {c} to {ev.get('shards')} shards of {self.shards}")
    skipped, most = ev.get("skipped"), self.k[i] * self.nm[i]
    if skipped is not None and not (self.precision == "fp16" and isinstance(skipped, int) and 1 <= skipped <= most):
      self.fail("push", f"VW {i} wave {c} says {skipped!r} updates were skipped; only an fp16 run skips "
                f"(this is {self.precision}), 1 to stages x Nm = {most} per wave")
    if self._gone(i, lambda: f"push of wave {c}"):
      return
    self.clock = wsp.push(self.clock, i)
    self._changed(i)
    self.pulled_since_push[i] = False
    self._ahead_after_push(i)

  def _ahead_after_push(self, i: int) -> None:
    """Reports, in order, every live VW beyond D + 1 of the global clock after VW ``i``'s push."""
    # A push moves no other VW ahead (the global clock only rises): only the pusher and those already beyond
    # D + 1 can be beyond it now; each such VW is reported at every push, as long as it stays beyond.
    self.ahead = self._beyond(self.ahead | {i})
    for k in sorted(self.ahead):
      self.fail("gate", f"VW {k} runs {wsp.clock_gap(self.clock, k)} waves ahead of the slowest (clocks "
                f"{list(self.clock.c_local)}); WSP allows D + 1 = {self.d + 1}")

  def _beyond(self, vws) -> set[int]:
    """The live VWs of ``vws`` beyond D + 1 of the global clock."""
    return {k for k in vws if k not in self.clock.left and wsp.clock_gap(self.clock, k) > self.d + 1}

  def _on_pull(self, ev) -> None:
    i, glob = ev["vw"], self._base(ev)
    if i in self.clock.left:
      return self.fail("member", f"pull of VW {i}, which left and has not joined again")
    self.joining.discard(i)
    if self._unknown(glob, f"pull of VW {i}"):
      return
    if isinstance(glob, int):  # a seq, while no VW left or joined: its clocks are what was pushed, at most
      if self.clock.c_local[i] - self.lows[glob] > self.d:
        self.fail("gate", f"VW {i} pulled at clock {self.clock.c_local[i]} with global clock {self.lows[glob]}; "
                  f"the gate allows D = {self.d}")
      self.pulls[i].add(glob)
      self.pulled_since_push[i] = True
      return
    if len(glob) != self.n:
      return self.fail("format", f"pull of VW {i}: glob has {len(glob)} entries for {self.n} VWs")
    if any(map(operator.gt, glob, self.clock.c_local)):
      for k, g in enumerate(glob):
        if g > self.clock.c_local[k]:
          self.fail("global", f"VW {i} pulled {g} waves of VW {k}, which had pushed {self.clock.c_local[k]}")
    left = self.clock.left
    global_clock = min(g for k, g in enumerate(glob) if k not in left) if left else min(glob)
    if self.clock.c_local[i] - global_clock > self.d:
      self.fail("gate", f"VW {i} pulled at clock {self.clock.c_local[i]} with global clock {global_clock}; "
                f"the gate allows D = {self.d}")
    self.pulls[i].add(glob)
    self.pulled_since_push[i] = True

  def _on_wait(self, ev) -> None:
    pass  # times are checked for every event

  def _on_applied(self, ev) -> None:
    """A copy of PS shards (process ``owner``, holding ``units``) says how many waves of the VW it applied by
    the end of the run (a multi-process run's last lines): checked against the trace's pushes at its end."""
    self.applied_lines.append((self.line, ev["vw"], ev["owner"], list(ev["units"]), ev["waves"]))

  # --- membership ------------------------------------------------------------------------------------

  def _on_leave(self, ev) -> None:
    i = ev["vw"]
    self._to_clocks()
    if self._gone(i, lambda: "leave"):
      return
    if ev.get("pushed", self.clock.c_local[i]) != self.clock.c_local[i]:
      self.fail("member", f"VW {i} left with {ev['pushed']} waves pushed; the trace shows "
                f"{self.clock.c_local[i]}")
    self.clock = wsp.leave(self.clock, i)
    self.ahead = self._beyond(range(self.n))  # (the global clock may move either way)

  def _on_join(self, ev) -> None:
    i, c = ev["vw"], ev["clock"]
    self._to_clocks()
    if i not in self.clock.left:
      return self.fail("member", f"VW {i} joined without having left")
    expected = wsp.join(self.clock, i).c_local[i]
    if c != expected:
      self.fail("member", f"VW {i} joined at clock {c}; the global clock of the live VWs is {expected}")
    self.clock = wsp.join(self.clock, i, c)
    self._changed(i)
    self.ahead = self._beyond(range(self.n))  # (the global clock may move either way)
    start = c * self.nm[i]  # it runs the minibatches of waves c, c+1, ... on fresh stages
    self.injected[i] = self.completed[i] = start
    self.done.forget(i)
    for j in range(self.k[i]):
      d = _device(self.devices, i, j)
      d.applied, d.last_glob, d.forwards = start, None, {}
    self.pulls[i] = set()
    self.pulled_since_push[i] = False
    self.joining.add(i)  # its first event must be its pull

  def finish(self) -> None:
    covered: list[set[int]] = [set() for _ in range(self.n)]
    for line, i, owner, units, waves in self.applied_lines:
      covered[i].update(units)
      if waves != self.clock.c_local[i]:
        self.fail("applied", f"line {line}: the copy of units {units} in process {owner} applied {waves} waves of "
                  f"VW {i}, which pushed {self.clock.c_local[i]}")
    if self.applied_lines and self.shards is not None:
      for i, units in enumerate(covered):
        if missing := sorted(set(range(self.shards)) - units):
          self.fail("applied", f"no copy of the PS shards of units {missing} says what it applied of VW {i}")
    for i in range(self.n):
      if i in self.clock.left:
        continue  # it left: its unfinished work was dropped (the leave event says how much)
      if self.completed[i] != self.injected[i]:
        self.fail("end", f"VW {i} injected {self.injected[i]} minibatches but completed "
                  f"{self.completed[i]}")
      if self.clock.c_local[i] != self.completed[i] // self.nm[i]:
        self.fail("end", f"VW {i} completed {self.completed[i] // self.nm[i]} waves but pushed "
                  f"{self.clock.c_local[i]}")


REQUIRED_META = ("num_vws", "nm", "d", "stages", "weight_mode")


def _meta_violation(meta: Any) -> Violation | None:
  """What is wrong with a trace's first line, or None when it is a meta line the checker reads."""
  if not isinstance(meta, dict) or meta.get("ev") != "meta":
    return Violation(1, "format", "the first line must be the meta event")
  missing = [f for f in REQUIRED_META if f not in meta]
  if missing:
    return Violation(1, "format", f"meta lacks {missing}")
  if (error := field_error(meta)) is not None:
    return Violation(1, "format", f"meta: {error}")
  if meta.get("version", 1) not in VERSIONS:
    return Violation(1, "format", f"meta version {meta['version']!r}: this checker reads versions "
                     f"{', '.join(map(str, VERSIONS))}; write the trace with this code's tools")
  window, nm = meta.get("window"), meta["nm"]
  if window is not None and (len(window) != len(nm) or not all(1 <= w <= n for w, n in zip(window, nm))):
    return Violation(1, "format", f"meta window {window} must give 1 <= window <= Nm for each Nm of {nm}")
  acc = meta.get("accumulate")
  if acc is not None and (not isinstance(acc, list) or len(acc) != len(nm)
                          or not all(type(k) is int and k >= 1 and n % k == 0 for k, n in zip(acc, nm))):
    return Violation(1, "format", f"meta accumulate {acc} must give a k >= 1 that divides Nm for each Nm of {nm}")
  return None


_BATCH = 4096  # events a StreamCheck holds before it checks them together (timed once, not twice an event)


class StreamCheck:
  """Checks a trace as its events come (a :class:`~hetpipe_jax.core.trace.Trace`'s sink: at most ``_BATCH``
  events are held, then checked together), to the verdict :func:`check_trace` gives the whole list;
  :meth:`finish` returns it. ``seconds`` is the time spent checking, shared with every :meth:`fresh` copy (a run
  started over checks again, and that time counts)."""

  def __init__(self, seconds: list[float] | None = None):
    self._seconds = seconds if seconds is not None else [0.0]
    self._checker: _Checker | None = None
    self._early: list[Violation] = []  # a bad meta line: nothing after it is checked
    self._line = 0  # events checked
    self._held: list[dict[str, Any]] = []  # events come and not checked yet

  @property
  def seconds(self) -> float:
    return self._seconds[0]

  def fresh(self) -> StreamCheck:
    return StreamCheck(self._seconds)

  def __call__(self, event: dict[str, Any]) -> None:
    held = self._held
    held.append(event)
    if len(held) >= _BATCH:
      self._held = []
      self._check(held)

  def _check(self, events: list[dict[str, Any]]) -> None:
    """Checks ``events``, the next ones in order."""
    t0 = time.perf_counter()
    it, line = iter(events), self._line
    if line == 0:
      for meta in it:  # (the first event, if any)
        line = 1
        bad = _meta_violation(meta)
        self._early = [bad] if bad else []
        self._checker = None if bad else _Checker(meta)
        break
    checker = self._checker
    if checker is None:  # (a bad meta line: nothing after it is checked)
      line += sum(1 for _ in it)
    else:
      check = checker.event
      for event in it:
        line += 1
        checker.line = line
        check(event)
    self._line = line
    self._seconds[0] += time.perf_counter() - t0

  def finish(self) -> list[Violation]:
    """Every violation of the events seen (those held checked now, and the end's rules)."""
    held, self._held = self._held, []
    self._check(held)
    if self._line == 0:
      return [Violation(1, "format", "the first line must be the meta event")]
    if self._checker is None:
      return self._early
    t0 = time.perf_counter()
    self._checker.line = self._line
    self._checker.finish()
    self._seconds[0] += time.perf_counter() - t0
    return self._checker.violations


def check_trace(events: Iterable[dict[str, Any]]) -> list[Violation]:
  """Returns every violation of the WSP guarantees in ``events`` (empty when the trace is sound)."""
  stream = StreamCheck()
  for event in events:
    stream(event)
  return stream.finish()


def as_version_1(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
  """The events of a trace in today's form, version 1: a version-2 trace's tasks and pulls with the N-entry
  ``glob`` of their ``seq`` in its place (every other event, and a version-1 trace, as they are). The clocks of a
  seq are what the checker replaying the trace holds after that many changes: for a trace the engine wrote in
  both versions, the two are the same event for event.

  Raises:
    ConfigError: when a seq names a change not made before it (line number given): no clocks to write.
  """
  it = iter(events)
  meta = next(it, None)
  if meta is None or meta.get("version") != 2 or meta.get("ev") != "meta":
    yield from ([] if meta is None else [meta])
    yield from it
    return
  checker = _Checker(meta)
  yield {**meta, "version": 1}
  for line, ev in enumerate(it, start=2):
    seq = ev.get("seq") if ev.get("ev") in ("fwd", "bwd", "pull") else None
    if seq is not None:
      if not (type(seq) is int and 0 <= seq <= checker.clock.seq):
        raise ConfigError(f"line {line}: seq = {seq!r} names no change made before it ({checker.clock.seq} "
                          "were); this trace cannot be written in version 1")
      glob = list(checker._glob(seq))
      ev = {("glob" if k == "seq" else k): (glob if k == "seq" else v) for k, v in ev.items()}
    checker.line = line
    checker.event(ev if seq is None else {**ev, "seq": seq})
    yield ev


def require_wsp(events: Iterable[dict[str, Any]], what: str, error: type[Exception] = ProtocolError) -> None:
  """Raises ``error`` (a breach is a bug in the runtime, never bad input) with the number of violations and the
  first three when ``events`` break a WSP guarantee (``what`` names the run in the message)."""
  raise_violations(check_trace(events), what, error)


def raise_violations(violations: Sequence[Violation], what: str, error: type[Exception] = ProtocolError) -> None:
  """Raises ``error`` with the number of ``violations`` and the first three, if there are any."""
  if violations:
    raise error(f"{what}: the trace breaks WSP, {len(violations)} violations; first: "
                + "; ".join(str(v) for v in violations[:3]))


USAGE = "python -m hetpipe_jax.check TRACE.jsonl [--version_1=OUT.jsonl]"


def main(argv: list[str]) -> int:
  """``python -m hetpipe_jax.check TRACE``: exit 0 and the observed staleness, or 1 and every violation;
  with ``--version_1=OUT``, a sound trace is also written to OUT in today's form (:func:`as_version_1`)."""
  out = [a.split("=", 1)[1] for a in argv[2:] if a.startswith("--version_1=")]
  if len(out) != len(argv[2:]) or any(not path for path in out):
    print(f"usage: {USAGE} (unknown argument {' '.join(argv[2:])})", file=sys.stderr)
    return 2
  return trace_cli(argv, USAGE, 2, lambda events, _: _report(events, argv[1], out[0] if out else None))


def _report(events: list[dict[str, Any]], path: str, version_1: str | None) -> int:
  violations = check_trace(events)
  if violations:
    for v in violations[:50]:
      print(v)
    print(f"FAILED: {len(violations)} violations of the WSP guarantees in {path}")
    return 1
  events = list(as_version_1(events))
  if version_1:
    write_trace(version_1, events)
    print(f"wrote {version_1}: the trace in version 1, every task and pull with its glob")
  stats = staleness_stats(events)
  print(f"OK: {len(events)} events in {path} satisfy every WSP guarantee")
  print(json.dumps(stats, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
