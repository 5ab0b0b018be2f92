"""Where every GPU-second of a run goes, read from its trace (any executor).

Each GPU (a virtual worker's stage) spends the run ``[0, T]`` (T: the trace's last time) in exactly one
of these states at every moment, so the shares add up to 1:

* ``compute``: running a task (its compute part, when the task's compute time is known);
* ``link``: inside a task, receiving its input over the link (the executors charge the receive in series,
  as the device's time: the task's time minus its compute time);
* ``bubble``: idle, waiting for its input from the previous or next stage (the pipeline's fill, drain and
  imbalance);
* ``window``: stage 0 idle because the window is full (no minibatch may enter before one completes: its
  next task is a forward that could not enter, or a backward while Nm minibatches, or the window's count
  where the trace sets one, are in flight);
* ``gate``: idle while its virtual worker is blocked at the WSP gate (the trace's ``wait``);
* ``pull``: idle while its virtual worker's pull travels (the gate is open, the weights not there yet;
  with staged pulls, whose parts land stage by stage, stage 0's part holds the virtual worker, and a later
  stage is also held from when the gated minibatch's forward reached it until that stage's part landed);
* ``push``: idle while its virtual worker waits for its own last push to land before the next wave;
* ``done``: idle after its last task, while others still run;
* ``left``: its virtual worker had failed and not (yet) been replaced.

The virtual-worker states (gate, pull, push) take precedence over the device's own reason when both
hold. A pull's travel starts when its gate opened: the end of the ``wait`` just before it, else when the
gated minibatch could enter (the completion that opened its Nm window, or the landing of its own last
push), read from the trace. Pure: no JAX.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.core.trace import end_time

CATEGORIES = ("compute", "link", "bubble", "window", "gate", "pull", "push", "done", "left")
ComputeFn = Callable[[int, int, str], float]  # (vw, stage, kind) -> compute seconds on the trace's clock


def _vw_states(events: Sequence[dict[str, Any]], vw: int, nm: int, window: int) -> list[tuple[float, float, str]]:
  """Intervals ``(t0, t1, state)`` in which virtual worker ``vw`` (waves of ``nm``, at most ``window`` in
  flight) is blocked: at the gate, pulling, or waiting for its own push; and ``left`` (between a leave and
  the next join, or the end)."""
  complete, push, out = {}, {}, []
  waits: list[tuple[float, float]] = []
  left_at = None
  end = end_time(events)
  for e in events[1:]:
    if e.get("vw") != vw:
      continue
    kind = e["ev"]
    if kind == "complete":
      complete[e["mb"]] = e["t"]
    elif kind == "push":
      push[e["wave"]] = e["t"]
    elif kind == "wait":
      waits.append((e["t0"], e["t1"]))
      out.append((e["t0"], e["t1"], "gate"))
    elif kind == "leave":
      left_at = e["t"]
    elif kind == "join" and left_at is not None:
      out.append((left_at, e["t"], "left"))
      left_at = None
  if left_at is not None:
    out.append((left_at, end, "left"))
  # pulls: from the gate opening (or the gated minibatch's readiness) to the pull's arrival
  injects = sorted((e["t"], e["mb"]) for e in events[1:] if e["ev"] == "inject" and e["vw"] == vw)
  times = [t for t, _ in injects]
  wait_ends = sorted(w1 for _, w1 in waits)
  for e in events[1:]:
    if e["ev"] != "pull" or e["vw"] != vw or e.get("stage", 0):
      continue
    t = e["t"]
    at = bisect.bisect_left(times, t)  # the gated minibatch: the first injected from the pull on
    if at == len(injects):
      continue
    mb = injects[at][1]
    wave = (mb - 1) // nm
    gate = bisect.bisect_right(wait_ends, t)  # the last gate that opened by then
    ready = [complete.get(mb - window), push.get(wave - 1), wait_ends[gate - 1] if gate else None]
    start = max([r for r in ready if r is not None and r <= t], default=t)
    if start < t:
      out.append((start, t, "pull"))
    own = push.get(wave - 1)
    last = complete.get(wave * nm)
    if own is not None and last is not None and last < own:  # its own last push in flight
      out.append((last, own, "push"))
  return out


def _staged_pulls(events: Sequence[dict[str, Any]], finished: dict[tuple[str, int, int, int], float]
                  ) -> dict[tuple[int, int], list]:
  """Staged pulls: per device (vw, stage > 0), the intervals in which the gated minibatch's forward had
  reached it (its forward at the stage before had ended) but the stage's part of the pull had not landed.
  A pull's parts carry the same snapshot (``glob``, or ``seq`` in version 2: new at every pull of a virtual
  worker); its gated
  minibatch is the first injected from its stage-0 part's landing on."""
  gated: dict[tuple[int, tuple[int, ...] | int], int] = {}  # (vw, snapshot) -> gated minibatch
  pending: dict[int, tuple[int, ...] | int] = {}  # vw -> snapshot whose stage-0 part landed, nothing injected yet
  parts = []
  for e in events[1:]:
    kind = e["ev"]
    if kind == "pull" and "stage" in e:
      if e["stage"]:
        parts.append(e)
      else:
        pending[e["vw"]] = _snapshot(e)
    elif kind == "inject" and e["vw"] in pending:
      gated[(e["vw"], pending.pop(e["vw"]))] = e["mb"]
  out: dict[tuple[int, int], list] = {}
  for e in parts:
    i, j, t = e["vw"], e["stage"], e["t"]
    mb = gated.get((i, _snapshot(e)))
    reached = None if mb is None else finished.get(("fwd", i, j - 1, mb))
    if reached is not None and reached < t:
      out.setdefault((i, j), []).append((reached, t, "pull"))
  return out


def _carve(a: float, b: float, states: Sequence[tuple[float, float, str]], rest: str,
           into: dict[str, float]) -> None:
  """Adds the idle interval [a, b) to ``into``: the parts covered by ``states`` (first listed wins
  where they overlap) to their state, the rest to ``rest``."""
  if b <= a:
    return
  cuts = sorted({a, b} | {x for s0, s1, _ in states for x in (s0, s1) if a < x < b})
  for lo, hi in zip(cuts, cuts[1:]):
    mid = (lo + hi) / 2
    state = next((s for s0, s1, s in states if s0 <= mid < s1), rest)
    into[state] = into.get(state, 0.0) + hi - lo


class _Index(NamedTuple):
  """What the breakdown looks up in a trace (:func:`_index`)."""

  finished: dict[tuple[str, int, int, int], float]  # (kind, vw, stage, mb) -> t1
  injected: dict[tuple[int, int], float]  # (vw, mb) -> t
  tasks: dict[tuple[int, int], list[dict[str, Any]]]  # (vw, stage) -> its task events
  entered: dict[int, list[float]]  # vw -> injection times (sorted: file order is causal order)
  left: dict[int, list[float]]  # vw -> completion times

  def window_full(self, i: int, t: float, window: int) -> bool:
    """Whether VW i's minibatches in flight at ``t`` fill its window."""
    in_flight = bisect.bisect_right(self.entered.get(i, []), t) - bisect.bisect_right(self.left.get(i, []), t)
    return in_flight >= window


def _index(events: Sequence[dict[str, Any]]) -> _Index:
  """The tasks, injections and completions of a trace, indexed."""
  index = _Index({}, {}, {}, {}, {})
  for e in events[1:]:
    if e["ev"] in ("fwd", "bwd"):
      index.finished[(e["ev"], e["vw"], e["stage"], e["mb"])] = e["t1"]
      index.tasks.setdefault((e["vw"], e["stage"]), []).append(e)
    elif e["ev"] == "inject":
      index.injected[(e["vw"], e["mb"])] = e["t"]
      index.entered.setdefault(e["vw"], []).append(e["t"])
    elif e["ev"] == "complete":
      index.left.setdefault(e["vw"], []).append(e["t"])
  return index


def _device_seconds(index: _Index, i: int, j: int, k: int, held: Sequence[tuple[float, float, str]],
                    window: int, compute: ComputeFn | None) -> tuple[dict[str, float], float]:
  """Stage j (of k) of VW i: its seconds per category until its last task ended (the idle time covered
  by the ``held`` states goes to theirs), and when that was."""
  secs: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
  finished = index.finished
  free = 0.0  # when the device last became idle
  for e in sorted(index.tasks.get((i, j), []), key=lambda e: e["t0"]):
    kind, mb = e["ev"], e["mb"]
    if kind == "fwd":
      ready = index.injected.get((i, mb)) if j == 0 else finished.get(("fwd", i, j - 1, mb))
    else:
      ready = finished.get(("fwd", i, j, mb)) if j == k - 1 else finished.get(("bwd", i, j + 1, mb))
    ready = free if ready is None else min(max(ready, free), e["t0"])
    waiting = "window" if j == 0 and (kind == "fwd" or index.window_full(i, free, window)) else "bubble"
    _carve(free, ready, held, waiting, secs)
    _carve(ready, e["t0"], held, "link", secs)  # input ready, the task not started yet: dispatch
    task = e["t1"] - e["t0"]
    c = task if compute is None else min(task, compute(i, j, kind))
    secs["compute"] += c
    secs["link"] += task - c
    free = e["t1"]
  return secs, free


def time_breakdown(events: Sequence[dict[str, Any]], compute: ComputeFn | None = None) -> dict[str, Any]:
  """Seconds per category (see the module docstring) of every GPU of a run.

  Args:
    events: the trace (its meta line first).
    compute: the compute time of a task on the trace's clock, if known (else a whole task is compute).

  Returns:
    ``{"seconds": T, "devices": [{"vw", "stage", "gpu", "seconds": {category: s}}, ...]}``; each
    device's seconds add up to T.
  """
  meta = events[0]
  end = end_time(events)
  order = {"gate": 0, "left": 0, "pull": 1, "push": 2}
  windows = meta.get("window") or meta["nm"]
  states = {i: sorted(_vw_states(events, i, nm, w), key=lambda s: order[s[2]])
            for i, (nm, w) in enumerate(zip(meta["nm"], windows))}
  index = _index(events)
  staged = _staged_pulls(events, index.finished)
  gpus = meta.get("gpus")
  devices = []
  for i, k in enumerate(meta["stages"]):
    for j in range(k):
      secs, free = _device_seconds(index, i, j, k, states[i] + staged.get((i, j), []), windows[i], compute)
      _carve(free, end, [s for s in states[i] if s[2] == "left"], "done", secs)
      devices.append({"vw": i, "stage": j, "gpu": gpus[i][j] if gpus else f"vw{i}.{j}", "seconds": secs})
  return {"seconds": end, "devices": devices}


def shares(breakdown: dict[str, Any]) -> list[dict[str, float]]:
  """Each device's seconds as fractions of the run."""
  end = breakdown["seconds"] or 1.0
  return [{c: s / end for c, s in d["seconds"].items()} for d in breakdown["devices"]]


def pushed_images(events: Sequence[dict[str, Any]], batch_size: int) -> list[int]:
  """Images in the waves each virtual worker pushed to the parameter server."""
  nms = events[0]["nm"]
  out = [0] * len(nms)
  for e in events[1:]:
    if e["ev"] == "push":
      out[e["vw"]] += nms[e["vw"]] * batch_size
  return out


def _snapshot(pull: dict[str, Any]) -> tuple[int, ...] | int:
  """What names a pull's snapshot: its ``seq`` (trace version 2) or its clocks (version 1)."""
  return pull["seq"] if "seq" in pull else tuple(pull["glob"])
