"""Where the time of each system's best row of the throughput study goes (issue 38, item 5).

For every system of a model's table, its row of the most examples/s is broken down over every GPU that trains:
HetPipe's from its simulated trace again (:func:`hetpipe_jax.core.breakdown.time_breakdown`, the tasks' compute
from the cost model; a tensor-parallel stage's partners count as its lead, whose timeline they repeat), a peer's
from its timeline (:func:`hetpipe_jax.baselines.timeline.timeline_report`). The shares are the mean over the
GPUs of the fraction of the run spent in each category; each system has its own categories (HetPipe's compute,
link, bubble, window, gate, pull, push, done, left; a peer's compute, link, bubble, allreduce, sync, unused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hetpipe_jax.baselines.timeline import timeline_report
from hetpipe_jax.core.breakdown import shares, time_breakdown
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.sim import SimJob, simulate
from hetpipe_jax.studies.throughput_records import TableEntry


def mean_shares(per_device: Sequence[Mapping[str, float]], weights: Sequence[float] | None = None) -> dict[str, float]:
  """The weighted mean of every device's share of each category (equal weights by default)."""
  weights = [1.0] * len(per_device) if weights is None else list(weights)
  total = sum(weights) or 1.0
  categories = list(dict.fromkeys(c for d in per_device for c in d))
  return {c: sum(w * d.get(c, 0.0) for d, w in zip(per_device, weights)) / total for c in categories}


def hetpipe_shares(job: SimJob) -> dict[str, float]:
  """The mean shares of a HetPipe configuration's GPUs, from its simulated trace (each stage weighted by the GPUs
  it runs on)."""
  trace = Trace()
  simulate(job, trace)
  cost = CostModel(job.cluster, job.profiles, job.layout)
  breakdown = time_breakdown(trace.events, cost.compute_seconds)
  weights = [job.layout.vws[d["vw"]].degree(d["stage"]) for d in breakdown["devices"]]
  return mean_shares(shares(breakdown), weights)


def peer_shares(timeline: dict[str, Any]) -> dict[str, float]:
  """The mean shares of the GPUs a peer trains on (its timeline's unused GPUs left out)."""
  report = timeline_report(timeline)
  used = [s for s in report["shares"] if s.get("unused", 0.0) < 1.0]
  return mean_shares(used)


def best_row_breakdowns(table: Sequence[TableEntry], ran: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """Per system, its row of the most examples/s among those whose run is known (``ran``: a row's
  :class:`~hetpipe_jax.sim.SimJob` for HetPipe, its timeline for a peer): ``{"row", "shares"}``."""
  best: dict[str, TableEntry] = {}
  for e in table:
    if e.images_per_sec is not None and e.row in ran and (
        e.system not in best or e.images_per_sec > (best[e.system].images_per_sec or 0.0)):
      best[e.system] = e
  out = {}
  for system, e in best.items():
    what = ran[e.row]
    out[system] = {"row": e.row, "shares": hetpipe_shares(what) if isinstance(what, SimJob) else peer_shares(what)}
  return out
