"""The event trace (JSON Lines, file order = causal order) and staleness statistics drawn from it.

Format (docs/PROTOCOL.md section 8, where every event kind and field is listed)::

  {"ev":"meta","version":1,"num_vws":N,"nm":[...],"d":D,"stages":[...],"weight_mode":..,"executor":..}
  {"ev":"inject","vw":i,"mb":p,"t":...}
  {"ev":"fwd"|"bwd","vw":i,"stage":j,"mb":p,"t0":...,"t1":...,"own":q,"glob":[...]}
  {"ev":"complete","vw":i,"mb":p,"t":...}
  {"ev":"push","vw":i,"wave":c,"t":...,"shards":S}
  {"ev":"pull","vw":i,"t":...,"glob":[...]}
  {"ev":"wait","vw":i,"t0":...,"t1":...}
  {"ev":"leave","vw":i,"t":...}   {"ev":"join","vw":i,"t":...,"clock":c}   (membership)

``own`` counts the VW's own minibatch updates in the weights a task used; ``glob[k]`` the waves of VW k in
their global base. Extra fields are allowed. A ``sim`` run with staged PS transfers (``staged_ps`` in the
meta line) writes one pull line per stage, with its ``"stage":j``, when that stage's part lands.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from hetpipe_jax.core import wsp
from hetpipe_jax.errors import ConfigError


def _create(path: str, buffering: int = -1):
  """``path`` opened for writing, its folder created first (a run's output folder appears when it writes)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return open(path, "w", encoding="utf-8", buffering=buffering)  # noqa: SIM115 (the caller closes it)


class Sink(Protocol):
  """What a trace hands every event to as it is emitted (:class:`hetpipe_jax.core.check.StreamCheck`)."""

  def __call__(self, event: dict[str, Any]) -> None: ...

  def fresh(self) -> Sink:
    """A new sink of the same kind, for a run that starts over."""
    ...


class Trace:
  """Collects events in order (under one lock), optionally writes them as JSON Lines and hands each to a
  ``sink`` as it comes (a run checked as it goes: with ``keep=False`` and no file, nothing is held).
  ``version``: of the format its writer emits (1: every task and pull with its N-entry ``glob``; 2: its ``seq``)."""

  def __init__(self, path: str | None = None, keep: bool = True, line_buffered: bool = False, version: int = 1,
               sink: Sink | None = None):
    self.version = version
    self.sink = sink
    self.events: list[dict[str, Any]] = []
    self._keep = keep
    # (line_buffered: every event reaches the file at once, for a part of a run that may die)
    self._file = _create(path, buffering=1 if line_buffered else -1) if path else None
    self._lock = threading.Lock()

  def emit(self, **event) -> None:
    with self._lock:
      if self._keep:
        self.events.append(event)
      if self._file:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
      if self.sink is not None:
        self.sink(event)

  def extend(self, events: list[dict[str, Any]]) -> None:
    """Emits ``events`` in order (what :meth:`emit` does for each, without copying them)."""
    with self._lock:
      self._store(events)
      if self.sink is not None:
        for event in events:
          self.sink(event)

  def _store(self, events: list[dict[str, Any]]) -> None:
    """Keeps and writes ``events`` as this trace does (under its lock; the sink is the caller's)."""
    if self._keep:
      self.events.extend(events)
    if self._file:
      self._file.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in events)

  def scratch(self) -> Trace:
    """An empty trace like this one for a run that is either kept (:meth:`adopt`) or started over: it holds its
    events only where this one keeps or writes them, and hands them to a fresh sink."""
    return Trace(keep=self._keep or self._file is not None, version=self.version,
                 sink=None if self.sink is None else self.sink.fresh())

  def adopt(self, scratch: Trace) -> None:
    """Takes the events of ``scratch`` (from :meth:`scratch`, of a trace that holds none yet) as its own: its sink,
    which saw them, replaces this one's."""
    with self._lock:
      self._store(scratch.events)
      self.sink = scratch.sink

  def close(self) -> None:
    if self._file:
      self._file.close()
      self._file = None

  def flush(self) -> None:
    """Hands what was written so far to the operating system (a checkpoint counts on it)."""
    if self._file:
      self._file.flush()

  @classmethod
  def resume(cls, path: str, count: int, version: int = 1) -> Trace:
    """The trace of a resumed run: the first ``count`` events of the file at ``path`` are kept (what a
    killed run wrote after them is rolled back), and new events of format ``version`` are appended after them.

    Raises:
      ConfigError: when the file is missing, holds fewer than ``count`` complete events, or is of another
        version (the file is then left as it is).
    """
    try:
      with open(path, encoding="utf-8") as f:
        lines = [line for _, line in zip(range(count), f) if line.endswith("\n")]  # a cut line: not complete
      if len(lines) < count:
        raise ConfigError(f"cannot resume: trace {path} holds {len(lines)} complete events, the checkpoint "
                          f"needs its first {count}; resume with the trace the run wrote, or start afresh")
      events = [json.loads(line) for line in lines]
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"cannot resume: trace {path} is unreadable ({type(e).__name__}); the checkpoint "
                        f"needs its first {count} events") from None
    written = events[0].get("version", 1) if events and isinstance(events[0], dict) else version
    if written != version:
      raise ConfigError(f"resume: the trace {path} is of version {written}, the run asks for trace_version={version}; "
                        f"resume with trace_version={written}")
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(lines)
    trace = cls(version=version)
    trace.events = events
    trace._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open until close())
    return trace


def write_trace(path: str, events: Iterable[dict[str, Any]]) -> None:
  """Writes ``events`` as a JSON Lines trace (as :class:`Trace` does)."""
  with _create(path) as f:
    for event in events:
      f.write(json.dumps(event, separators=(",", ":")) + "\n")


# The type of each field of the format (docs/PROTOCOL.md section 8) a reader relies on: whole numbers,
# times, lists of whole numbers; what a reader does not know is not checked.
INT_FIELDS = ("vw", "stage", "mb", "own", "wave", "clock", "shards", "owner", "waves", "process", "num_vws", "d",
              "seq")
TIME_FIELDS = ("t", "t0", "t1")
INT_LIST_FIELDS = ("glob", "units", "nm", "stages")


# The exact types a field may have when it is sound (a bool is no whole number): the fast test of an event.
_SOUND = {**{f: (int,) for f in INT_FIELDS}, **{f: (int, float) for f in TIME_FIELDS},
          **{f: (list,) for f in INT_LIST_FIELDS}, "ev": (str,)}
_INT_TYPE = frozenset({int})


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _sound(event: dict[str, Any]) -> bool:
  """Whether every field of ``event`` the format names has exactly a sound type (one pass over its fields; the
  lists' entries at C speed). False may still be sound (a subclass): :func:`field_error` then decides."""
  for field, value in event.items():
    kinds = _SOUND.get(field)
    if kinds is None:
      continue
    if type(value) not in kinds:
      return False
    if kinds[0] is list and not set(map(type, value)) <= _INT_TYPE:
      return False
  return True


def field_error(event: dict[str, Any]) -> str | None:
  """What is wrong with the type of a field of ``event`` (the first such field), or None when every field
  the format names has its type: ``vw``, ``mb``, ... whole numbers, ``t``, ``t0``, ``t1`` numbers, ``glob``,
  ``units``, ``nm``, ``stages`` lists of whole numbers (and the meta's ``stages`` may be one)."""
  if _sound(event):
    return None
  if not isinstance(event.get("ev", ""), str):
    return f"ev = {event['ev']!r} must be an event name (a string)"
  for field in INT_FIELDS:
    if field in event and not _is_int(event[field]):
      return f"{field} = {event[field]!r} must be a whole number"
  for field in TIME_FIELDS:
    if field in event and (not isinstance(event[field], (int, float)) or isinstance(event[field], bool)):
      return f"{field} = {event[field]!r} must be a number (seconds)"
  for field in INT_LIST_FIELDS:
    value = event.get(field, [])
    if not (isinstance(value, list) and all(map(_is_int, value))) and not (field == "stages" and _is_int(value)):
      return f"{field} = {value!r} must be a list of whole numbers"
  return None


def read_trace(path: str) -> list[dict[str, Any]]:
  """The events of a JSON Lines trace file.

  Raises:
    ConfigError: when the file cannot be read, a line is not a JSON object, or a field of the format has
      the wrong type (:func:`field_error`), naming the line.
  """
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except OSError as e:
    raise ConfigError(f"cannot read trace {path}: {e.strerror}; give the path of a trace.jsonl") from None
  events = []
  for n, line in enumerate(lines, start=1):
    if line.strip():
      try:
        event = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"line {n} of {path} is not JSON ({e.msg}); a trace has one JSON object per "
                          "line") from None
      if not isinstance(event, dict):
        raise ConfigError(f"line {n} of {path} is {type(event).__name__}, not a JSON object")
      if (error := field_error(event)) is not None:
        raise ConfigError(f"line {n} of {path}: {event.get('ev')} event: {error}")
      events.append(event)
  return events


def read_whole_lines(path: str) -> list[dict[str, Any]]:
  """The events of a trace part whose writer may have died mid-line (a killed process's): every line up to the
  first that does not end in a newline or is not a JSON object (what the writer was cutting short), none when
  the file is not there."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = f.readlines()
  except OSError:
    return []
  events = []
  for line in lines:
    try:
      event = json.loads(line) if line.endswith("\n") else None
    except json.JSONDecodeError:
      event = None
    if not isinstance(event, dict):
      break
    events.append(event)
  return events


def end_time(events: Sequence[dict[str, Any]]) -> float:
  """The latest time in a trace (its meta line first): how long the run took on its executor's clock."""
  return max((max(ev.get("t", 0.0), ev.get("t1", 0.0)) for ev in events[1:]), default=0.0)


def staleness_stats(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """Observed staleness of a trace.

  * local staleness of a forward pass of p: own minibatches it misses, ``p - 1 - own`` (<= Nm - 1);
  * global staleness: ``p - 1 - Nm_i * min_{k != i} glob[k]`` in VW i's minibatches over the live VWs k
    (<= (D+2)*Nm_i - 2, only with more than one virtual worker);
  * clock gap: c_local - c_global of the pushing VW right after each push (<= D + 1);
  * blocked time: seconds each VW waited at the gate.

  A trace of version 2 is read in version 1 (:func:`hetpipe_jax.core.check.as_version_1` writes it so).
  """
  events = list(events)
  meta = events[0]
  n, nms, d = meta["num_vws"], meta["nm"], meta["d"]
  local, glob, gaps = collections.Counter(), collections.Counter(), collections.Counter()
  blocked = [0.0] * n
  clock = wsp.init(n)
  for ev in events[1:]:
    kind = ev["ev"]
    if kind == "fwd":
      i, p = ev["vw"], ev["mb"]
      local[p - 1 - ev["own"]] += 1
      others = [g for k, g in enumerate(ev["glob"]) if k != i and k not in clock.left]
      if others:
        glob[p - 1 - nms[i] * min(others)] += 1
    elif kind == "push":
      clock = wsp.push(clock, ev["vw"])
      gaps[wsp.clock_gap(clock, ev["vw"])] += 1
    elif kind == "wait":
      blocked[ev["vw"]] += ev["t1"] - ev["t0"]
    elif kind == "leave":
      clock = wsp.leave(clock, ev["vw"])
    elif kind == "join":
      clock = wsp.join(clock, ev["vw"], ev["clock"])
  return {
      "local_staleness": dict(sorted(local.items())),
      "local_bound": [wsp.local_staleness_bound(nm) for nm in nms],
      "global_staleness": dict(sorted(glob.items())),
      "global_bound": [wsp.global_staleness_bound(nm, d) for nm in nms],
      "max_global_staleness": max(glob) if glob else None,
      "clock_gap_after_push": dict(sorted(gaps.items())),
      "blocked_seconds": blocked,
      "run_seconds": end_time(events),
  }


def trace_cli(argv: list[str], usage: str, max_args: int,
              body: Callable[[list[dict[str, Any]], list[str]], int]) -> int:
  """Runs a trace tool's ``body(events, argv)`` on the trace named by ``argv[1]``.

  Returns 2 after printing ``usage`` (wrong argument count: 1 to ``max_args`` arguments) or one
  ``error:`` line (an unreadable or malformed trace), else what ``body`` returns.
  """
  if not 2 <= len(argv) <= max_args + 1:
    print(f"usage: {usage}", file=sys.stderr)
    return 2
  try:
    events = read_trace(argv[1])
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return body(events, argv)

