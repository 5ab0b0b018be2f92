"""The timeline of a simulated peer (:mod:`hetpipe_jax.baselines.sync`): where every GPU-second went.

A timeline is JSON: ``{"format": "hetpipe-timeline", "meta": {...}, "devices": [...], "intervals": [...]}``,
``meta`` naming the system, cluster, model, batch size, its images/s, the ideal heterogeneous aggregate
and the efficiency; ``devices`` one ``{"gpu", "vw", "stage"}`` per GPU of the cluster (``vw``: its
worker, -1 for a GPU no worker uses); ``intervals`` ``[device, start, end, category, label]`` covering
every device from 0 to the end, with the categories of :data:`CATEGORIES`:

* ``compute``: a forward or backward pass;
* ``link``: idle inside a local step while the input of its next task is in flight;
* ``bubble``: other idle time inside a local step (pipeline fill and drain, the flush);
* ``allreduce``: its round's work done, an all-reduce it takes part in running;
* ``sync``: its round's work done, waiting for slower workers (no all-reduce of its own running);
* ``unused``: a GPU that no worker uses.

``python -m hetpipe_jax.efficiency FILE.timeline.json`` reads it as it reads a HetPipe trace
(:func:`timeline_report`).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class Log:
  """What a run records for its timeline: per GPU index its compute intervals, the inputs in flight to
  it, its last compute before each synchronisation; the synchronisations (the rounds; with sharded weights,
  every micro-step: :class:`~hetpipe_jax.baselines.sync.SyncJob`); the communicators' all-reduces."""

  compute: dict[int, list[tuple[float, float, str]]] = dataclasses.field(default_factory=dict)
  inbound: dict[int, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
  last: dict[int, list[float]] = dataclasses.field(default_factory=dict)
  rounds: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  comms: list[tuple[tuple[int, ...], list[tuple[float, float]]]] = dataclasses.field(default_factory=list)


FORMAT = "hetpipe-timeline"
CATEGORIES = ("compute", "link", "bubble", "allreduce", "sync", "unused")
EPS = 1e-12


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for a, b in sorted(spans):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def _split(a: float, b: float, covered: Sequence[tuple[float, float]], ends: Sequence[float], inside: str,
           outside: str) -> list[tuple[float, float, str]]:
  """[a, b] cut into the parts inside ``covered`` (a sorted union, ``ends`` its intervals' ends) and the rest."""
  out, t = [], a
  for k in range(bisect.bisect_right(ends, a), len(covered)):  # (the first interval that ends after a)
    c, d = covered[k]
    if c >= b:
      break
    c, d = max(c, a), min(d, b)
    if d <= c:
      continue
    if c > t:
      out.append((t, c, outside))
    out.append((c, d, inside))
    t = d
  if b > t:
    out.append((t, b, outside))
  return [x for x in out if x[1] - x[0] > EPS]


def _device_intervals(gpu: int, log: Log, comm_spans: list[tuple[float, float]]) -> list[tuple[float, float, str, str]]:
  compute = sorted(log.compute.get(gpu, []))
  inbound = _union(log.inbound.get(gpu, []))
  inbound_ends, comm_ends = [d for _, d in inbound], [d for _, d in comm_spans]
  out: list[tuple[float, float, str, str]] = []
  c = 0
  for r, (start, end) in enumerate(log.rounds):
    last = log.last[gpu][r]
    t = start
    while c < len(compute) and compute[c][0] < end - EPS:
      a, b, label = compute[c]
      out += [(x, y, cat, "") for x, y, cat in _split(t, a, inbound, inbound_ends, "link", "bubble")]
      out.append((a, b, "compute", label))
      t = b
      c += 1
    out += [(x, y, cat, "") for x, y, cat in _split(max(t, last), end, comm_spans, comm_ends, "allreduce",
                                                             "sync")]
  return out


def build_timeline(job: Any, log: Log) -> dict[str, Any]:
  """The timeline of a finished run of ``job`` (a :class:`~hetpipe_jax.baselines.sync.SyncJob`; see the module
  docstring); ``meta`` holds the system's knobs, the caller adds its rates."""
  position = {g.index: (i, j) for i, w in enumerate(job.workers) for j in range(len(w.gpus)) for g in w.stage_gpus(j)}
  end = log.rounds[-1][1] if log.rounds else 0.0
  devices, intervals = [], []
  for d, g in enumerate(job.cluster.gpus):
    worker, stage = position.get(g.index, (-1, 0))
    devices.append({"gpu": g.name, "vw": worker, "stage": stage})
    if worker < 0:
      intervals.append([d, 0.0, end, "unused", ""])
      continue
    spans = _union([s for members, spans in log.comms if g.index in members for s in spans])
    intervals += [[d, a, b, cat, label] for a, b, cat, label in _device_intervals(g.index, log, spans)]
  return {"format": FORMAT, "meta": {"system": job.system, "cluster": job.cluster.name, "seconds": end,
                                     "rounds": job.rounds, "precision": job.precision, **dict(job.knobs)},
          "devices": devices, "intervals": intervals}


def timeline_report(doc: dict[str, Any]) -> dict[str, Any]:
  """The breakdown of a timeline as :func:`hetpipe_jax.efficiency.efficiency_report` gives a trace's:
  ``seconds``, ``devices``, ``shares`` (per device, the fraction of the run in each category), ``categories``,
  ``note``, and from ``meta`` the images/s, the ideal aggregate and the efficiency."""
  seconds = float(doc["meta"]["seconds"])
  totals = [dict.fromkeys(CATEGORIES, 0.0) for _ in doc["devices"]]
  for d, a, b, cat, _ in doc["intervals"]:
    totals[d][cat] += b - a
  shares = [{c: (v / seconds if seconds > 0 else 0.0) for c, v in t.items()} for t in totals]
  meta = doc["meta"]
  report: dict[str, Any] = {"seconds": seconds, "devices": doc["devices"], "shares": shares,
                            "categories": list(CATEGORIES), "note": None, "system": meta["system"]}
  for key in ("images_per_sec", "ideal_images_per_sec", "efficiency"):
    if key in meta:
      report[key] = meta[key]
  return report


def is_timeline(path: str) -> bool:
  """Whether ``path`` holds a timeline (JSON whose ``format`` is :data:`FORMAT`) rather than a trace."""
  if not path.endswith(".json"):
    return False
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False
