"""One trace from many writers: the parts that the processes of a decentralised run write, merged in causal
order by the events' identities and causal keys, never by comparing the clocks of different processes.

Each part is one process's events in the order they happened there. Across parts, an event may come only
after the events it causally follows (its *causal keys*), which the merge reads from the events themselves:

=================================  ===========================================================
event                              comes after
=================================  ===========================================================
``fwd`` of minibatch p at stage j  the ``fwd`` of p at stage j - 1 (its input; at stage 0 its ``inject``)
``bwd`` of p at stage j            the ``bwd`` of p at stage j + 1 (its gradient; at the last stage its
                                   ``fwd``)
``complete`` of p                  the ``bwd`` of p at stage 0
``push`` of wave c of VW i         ``complete`` of VW i's minibatch (c + 1) * Nm
``pull`` holding waves glob        the ``push`` of wave glob[v] - 1 of every VW v
                                   (the snapshot holds exactly those waves), and the
                                   ``leave`` of every VW it names in ``left``
``applied``: c waves of VW i       the ``push`` of VW i's wave c - 1 (a copy of PS shards applied
                                   them all)
=================================  ===========================================================

A virtual worker that left (the clock's ``leave`` line) may leave events that cannot be placed (what they
follow died with a process) or that its stages wrote after it left: they are left out, unrecorded, except
its pushes, which happened (the clock counted them and the owners applied them): a push whose wave's
history died with a process is placed with ``"history": "lost"``.

Within those constraints the merge takes, among the parts whose next event may come, the one whose event
happened earliest on its own process's clock (ties: the lower part), so a run's merged trace reads in about
the order things happened, but a skew between the clocks can never reorder causally related events. Every
time field stays as its process wrote it; the checker compares times only within a process
(``process`` field).

``python -m hetpipe_jax.core.merge OUT META PART...`` merges part files on demand (e.g. of a run that died:
the events that cannot be placed, because what they follow was never written, are reported and left out).
"""

from __future__ import annotations

import collections
import heapq
import json
import sys
from collections.abc import Sequence
from typing import Any

Key = tuple  # an event's identity as a causal key


def provides(ev: dict[str, Any]) -> Key | None:
  """The causal key an event is (what later events may follow), or None."""
  kind = ev["ev"]
  if kind in ("fwd", "bwd"):
    return (kind, ev["vw"], ev["stage"], ev["mb"])
  if kind in ("complete", "inject"):
    return (kind, ev["vw"], ev["mb"])
  if kind == "push":
    return ("push", ev["vw"], ev["wave"])
  if kind == "leave":
    return ("leave", ev["vw"])
  return None


def requires(ev: dict[str, Any], nm: Sequence[int], stages: Sequence[int]) -> list[Key]:
  """The causal keys that must come before ``ev`` in the merged trace (see the module docstring)."""
  kind = ev["ev"]
  if kind == "fwd":
    return [("fwd", ev["vw"], ev["stage"] - 1, ev["mb"]) if ev["stage"] > 0 else ("inject", ev["vw"], ev["mb"])]
  if kind == "bwd":
    last = ev["stage"] == stages[ev["vw"]] - 1
    return [("fwd" if last else "bwd", ev["vw"], ev["stage"] + (0 if last else 1), ev["mb"])]
  if kind == "complete":  # (in the same part; written out so that leaving out an event leaves out what follows it)
    return [("bwd", ev["vw"], 0, ev["mb"])]
  if kind == "push":
    return [("complete", ev["vw"], (ev["wave"] + 1) * nm[ev["vw"]])]
  if kind == "applied":
    return [("push", ev["vw"], ev["waves"] - 1)] if ev["waves"] > 0 else []
  if kind == "pull":  # (and the leaves that had opened its gate)
    return [("push", v, g - 1) for v, g in enumerate(ev["glob"]) if g > 0] + [("leave", v) for v in ev.get("left", ())]
  return []


def _time(ev: dict[str, Any]) -> float:
  return max(ev.get(f, 0.0) for f in ("t", "t0", "t1"))


class _Merger:
  """The state of one merge (:func:`merge`): each part's next event, what it waits for, and the output."""

  def __init__(self, meta: dict[str, Any], parts: Sequence[Sequence[dict[str, Any]]]):
    self.nm, self.stages, self.parts = meta["nm"], meta["stages"], parts
    self.leaving = {ev["vw"] for part in parts for ev in part if ev["ev"] == "leave"}
    self.emitted: set[Key] = set()
    self.waiting: dict[Key, list[int]] = collections.defaultdict(list)  # a key -> parts whose next event needs it
    self.blocked: set[int] = set()  # parts whose next event waits
    self.ready: list[tuple[float, int]] = []
    self.at = [0] * len(parts)
    self.out, self.left, self.dropped = [meta], set(), 0
    for p in range(len(parts)):
      self.consider(p)

  def consider(self, p: int) -> None:
    """Queues part ``p``'s next event as ready, or as waiting for the first key it needs that is missing."""
    if self.at[p] < len(self.parts[p]):
      ev = self.parts[p][self.at[p]]
      missing = next((key for key in requires(ev, self.nm, self.stages) if key not in self.emitted), None)
      if missing is None:
        heapq.heappush(self.ready, (_time(ev), p))
      else:
        self.waiting[missing].append(p)
        self.blocked.add(p)

  def emit(self, key: Key | None) -> None:
    """Records ``key`` as placed and reconsiders the parts that waited for it."""
    if key is not None:
      self.emitted.add(key)
      for q in self.waiting.pop(key, ()):
        self.consider(q)

  def place_next(self) -> None:
    """Places the ready event of the earliest time (or drops it: recorded after its virtual worker left)."""
    _, p = heapq.heappop(self.ready)
    self.blocked.discard(p)
    ev = self.parts[p][self.at[p]]
    self.at[p] += 1
    if ev.get("vw") in self.left and ev["ev"] != "applied":  # (what the copies applied of it counts still)
      self.dropped += 1  # recorded after its virtual worker left
    else:
      self.out.append(ev)
      self.left.update([ev["vw"]] if ev["ev"] == "leave" else [])
    self.emit(provides(ev))
    self.consider(p)

  def release_stuck(self) -> bool:
    """With nothing ready: skips the next event of every part stuck on a virtual worker that left (a push is
    placed with ``"history": "lost"``, anything else left out). False when no part is stuck so."""
    parts, at = self.parts, self.at
    stuck = [p for p in sorted(self.blocked) if parts[p][at[p]]["vw"] in self.leaving
             and parts[p][at[p]]["ev"] != "applied"]
    for p in stuck:
      self.blocked.discard(p)
      for q in self.waiting.values():
        if p in q:
          q.remove(p)
      ev = parts[p][at[p]]
      at[p] += 1
      if ev["ev"] == "push":  # it happened (the clock counted it, the owners applied it); what it follows
        self.out.append({**ev, "history": "lost"})  # died with a process: the trace says so
        self.emit(("push", ev["vw"], ev["wave"]))
      else:
        self.dropped += 1
      self.consider(p)
    return bool(stuck)


def merge(meta: dict[str, Any], parts: Sequence[Sequence[dict[str, Any]]]
          ) -> tuple[list[dict[str, Any]], int, int]:
  """The events of ``parts`` (each in its process's order) in one causal order, after ``meta``.

  A virtual worker that left (its ``leave`` line, written by the clock, is in some part) may have events
  that cannot be placed, because what they follow died with a process, and events its stages recorded after
  it left, before they learnt it: both are left out (unrecorded, as the engine leaves a failed virtual
  worker's last tasks), so that the rest of their parts can be placed; but a push of it is placed, with
  ``"history": "lost"`` when what it follows died with a process.

  Returns:
    The merged trace (``meta`` first), how many events could not be placed (what they follow is in no part:
    a run that died; 0 for a complete run), and how many events of virtual workers that left were left out.
  """
  m = _Merger(meta, parts)
  while m.ready or m.release_stuck():  # stuck: an event of a VW that left may wait for what died with a process
    if m.ready:
      m.place_next()
  return m.out, sum(len(part) - i for part, i in zip(parts, m.at)), m.dropped


def _read(path: str) -> list[dict[str, Any]]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.endswith("\n")]  # a cut last line: not complete


def main(argv: list[str]) -> int:
  """``python -m hetpipe_jax.core.merge OUT META PART...``: writes the merged trace to OUT (META: a file whose
  first line is the meta event, e.g. process 0's part)."""
  if len(argv) < 4:
    print("usage: python -m hetpipe_jax.core.merge OUT META PART...", file=sys.stderr)
    return 2
  out_path, meta_path, *part_paths = argv[1:]
  meta = _read(meta_path)[0]
  if meta.get("ev") != "meta":
    print(f"error: the first line of {meta_path} is not the meta event", file=sys.stderr)
    return 2
  parts = [[ev for ev in _read(path) if ev.get("ev") != "meta"] for path in part_paths]
  events, unplaced, dropped = merge(meta, parts)
  with open(out_path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(ev, separators=(",", ":")) + "\n" for ev in events)
  print(f"merged {len(events) - 1} events of {len(parts)} parts into {out_path}"
        + (f"; {unplaced} events could not be placed (what they follow was never written)" if unplaced else "")
        + (f"; {dropped} events of virtual workers that left were left out" if dropped else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
