"""HetPipe's adaptation on the ``sim`` executor (issue 39, item 2): stages re-cut and waves re-sized from the
GPUs' measured speed, when it pays.

**What it measures.** Each stage's compute seconds as its kernels' timers give them, over what its profile
predicts (the simulator's :attr:`~hetpipe_jax.sim.network.Simulator.meter`): a GPU's *slowness* over the waves
since the last decision. Never the variance model's own speeds.

**The rule.** Every ``every`` waves (of the virtual worker with the fewest pushed), the planner plans again on the
*measured view* of the cluster: every GPU's type with its peaks divided by its slowness (rounded to
``resolution``, so that GPUs measured alike share a type), the same virtual workers (the same GPU groups), each
re-cut by the exact partitioner, Nm by the run's own rule (``speed``: waves re-sized to measured speed, with
windows). The run re-plans when that plan's modelled aggregate on the view (every virtual worker's Nm per the
longest wave: under WSP the slowest sets the pace) beats the running layout's on the same view by ``gain``, and
the time it would save over the rest of the run exceeds what the re-plan costs (below, as the planner models it:
a wave of the running layout lost at the barrier, and the moves' bytes one after another over the slower link).
A transient slowdown shorter than the interval moves the measurement less than the threshold; one that persists
across it re-plans, and the next decision re-plans back when it has passed.

**What a re-plan costs.** A barrier: no virtual worker injects again, those in flight complete (a wave left
unfinished is not pushed, and its minibatches are not counted: what a real run would finish is lost here, so the
cost is over-stated rather than hidden); then every unit whose GPU changes moves its weights and optimizer state
(its parameter bytes x (1 + optimizer slots)) from its old GPU to its new one, all at once on the simulator's
links; then the new layout starts from the parameter server's weights with fresh clocks: a WSP run of its own
(every virtual worker from the same weights), its trace checked on its own by :func:`simulate_replanning`.
Grouping (which GPUs form a virtual worker) is not changed, and layouts with tensor-parallel stages are not
re-planned (not built: a ConfigError says so).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.cluster import Cluster, Gpu, GpuType
from hetpipe_jax.core.check import require_wsp
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import layout_plan, plan_cluster
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.sim.network import Simulator
from hetpipe_jax.sim.noise import Realisation, realise
from hetpipe_jax.sim.simulate import SimJob, simulate

KEEP = "keep"  # Replanning.nm_rule: waves and in-flight counts as they are


class Replanning(NamedTuple):
  """The rule's knobs (see the module docstring): decide every ``every`` waves; re-plan when the view's plan is
  modelled ``gain`` faster; slowness rounded to ``resolution``; Nm by ``nm_rule`` (the planner's ``max_fit``,
  ``best`` or ``speed``, or ``keep``: every virtual worker keeps its waves and what it holds in flight, re-cut)."""

  every: int = 10
  gain: float = 0.03
  resolution: float = 0.02
  nm_rule: str = "max_fit"


class Segment(NamedTuple):
  """One layout's part of a re-planning run: its layout, when it started and ended, the minibatches of its pushed
  waves, the bytes moved before it, its trace (checked on its own), its virtual workers and metrics rows."""

  layout: Layout
  start: float
  end: float
  minibatches: int
  moved_bytes: float
  trace: Trace
  vws: list[VirtualWorker]
  rows: list[dict]


class _Watch:
  """Told of every push; at every decision point, measures and plans (:class:`Replanning`), and says stop when
  the view's plan pays."""

  def __init__(self, job: SimJob, costs: CostContext, rule: Replanning, simulator: Simulator):
    self.job, self.costs, self.rule, self.simulator = job, costs, rule, simulator
    self.pushed = [0] * job.layout.num_vws
    self.decide_at = rule.every
    self.seen: dict[tuple[int, int], list[float]] = {}  # the meter at the last decision
    self.replan: Layout | None = None

  def push(self, vw: int, t: float) -> None:
    del t
    self.pushed[vw] += 1

  def settled(self) -> bool:
    if self.replan is not None or min(self.pushed) < self.decide_at:
      return self.replan is not None
    self.decide_at += self.rule.every
    slowness = self._slowness()
    self.seen = {k: list(v) for k, v in self.simulator.meter.items()}
    if slowness:
      self.replan = better_layout(self.job, self.costs, self.rule, slowness, self.job.waves - min(self.pushed))
    return self.replan is not None

  def _slowness(self) -> dict[int, float]:
    """Each GPU's timed over profiled compute seconds since the last decision (a split stage's: its GPUs')."""
    out: dict[int, float] = {}
    for (vw, stage), (profiled, timed) in self.simulator.meter.items():
      before = self.seen.get((vw, stage), [0.0, 0.0])
      if profiled > before[0]:
        for g in self.job.layout.vws[vw].stage_gpus(stage):
          out[g.index] = (timed - before[1]) / (profiled - before[0])
    return out


def measured_view(cluster: Cluster, slowness: dict[int, float], resolution: float) -> Cluster:
  """``cluster`` as its measurements show it: each GPU's type with its peaks over its slowness (rounded to
  ``resolution``; a GPU not measured as it is)."""
  types: dict[tuple[str, float], GpuType] = {}
  gpus = []
  for g in cluster.gpus:
    s = round(slowness.get(g.index, 1.0) / resolution) * resolution
    if s <= 0 or math.isclose(s, 1.0):
      gpus.append(g)
      continue
    key = (g.type.name, s)
    if key not in types:
      types[key] = dataclasses.replace(g.type, name=f"{g.type.name} at {1 / s:.2f}", fp32_flops=g.type.fp32_flops / s,
                                       fp16_flops=g.type.fp16_flops / s, mem_bytes_per_s=g.type.mem_bytes_per_s / s)
    gpus.append(dataclasses.replace(g, type=types[key]))
  return dataclasses.replace(cluster, gpus=tuple(gpus))


def on(cluster: Cluster, layout: Layout) -> Layout:
  """``layout`` with ``cluster``'s GPUs of the same indices (a layout planned on a view, on the real cluster)."""
  by_index = {g.index: g for g in cluster.gpus}
  return Layout(tuple(dataclasses.replace(vw, gpus=tuple(by_index[g.index] for g in vw.gpus)) for vw in layout.vws))


def modelled_rate(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, costs: CostContext) -> float:
  """Minibatches per second of ``layout`` on ``cluster`` as the planner models WSP's pace: every virtual
  worker's Nm per the longest modelled wave."""
  plans = layout_plan(cluster, profiles, on(cluster, layout), costs=costs).vws
  return sum(p.nm for p in plans) / max(p.nm / p.throughput for p in plans)


def better_layout(job: SimJob, costs: CostContext, rule: Replanning, slowness: dict[int, float],
                  waves_left: int) -> Layout | None:
  """The layout the planner gives on the measured view, when it pays there (None otherwise, or when no partition
  of the view fits): modelled ``rule.gain`` faster than ``job``'s, and the time it saves over the ``waves_left``
  waves of the run larger than what the re-plan costs (a wave of the running layout, the longest, lost at the
  barrier, and its moves' bytes over the slower of the two links, one after another)."""
  view = measured_view(job.cluster, slowness, rule.resolution)
  groups = [[g.index for g in vw.gpus] for vw in job.layout.vws]
  keep = rule.nm_rule == KEEP
  try:
    plan = plan_cluster(view, job.profiles, groups, job.placement,
                        [vw.in_flight for vw in job.layout.vws] if keep else rule.nm_rule, None, costs)
  except ConfigError:
    return None
  planned = Layout(tuple(p.with_wave(vw.nm).layout for p, vw in zip(plan.vws, job.layout.vws))) if keep else \
      plan.layout
  now, then = (modelled_rate(view, job.profiles, lay, costs) for lay in (job.layout, planned))
  wave = sum(job.layout.nms) / now
  link = min(job.cluster.inter_node.bytes_per_s, job.cluster.intra_node.bytes_per_s)
  cost = wave + sum(m[2] for m in moved_bytes(job.profiles, job.layout, planned, costs.optimizer_slots)) / link
  saved = waves_left * sum(job.layout.nms) * (1 / now - 1 / then)
  return on(job.cluster, planned) if then > (1 + rule.gain) * now and saved > cost else None


def moved_bytes(profiles: Sequence[UnitProfile], old: Layout, new: Layout,
                slots: float) -> list[tuple[Gpu, Gpu, float]]:
  """(from GPU, to GPU, bytes) of every unit whose GPU changes: its weights and optimizer state."""
  moves = []
  for a, b in zip(old.vws, new.vws):
    for u, p in enumerate(profiles):
      src, dst = a.gpus[a.stage_of_unit(u)], b.gpus[b.stage_of_unit(u)]
      if src.index != dst.index and p.param_bytes:
        moves.append((src, dst, p.param_bytes * (1 + slots)))
  return moves


def _move(cluster: Cluster, moves: list[tuple[Gpu, Gpu, float]], start: float, noise: Realisation | None) -> float:
  """When the moves, all sent at ``start`` on the links (as the noise has them), have landed."""
  if not moves:
    return start
  network = Simulator(cluster, noise=noise, start=start)
  for src, dst, num_bytes in moves:
    network.send(src.node, dst.node, num_bytes, lambda _t: None)
  return network.drain()


def simulate_replanning(job: SimJob, costs: CostContext, rule: Replanning,
                        meta: Mapping[str, Any] | None = None, version: int = 1) -> list[Segment]:
  """``job`` (its noise from its options) under the rule (see the module docstring), for ``job.waves`` waves of
  the virtual worker with the fewest, in segments of one layout each (``meta``: what every segment's meta line
  adds, :func:`~hetpipe_jax.sim.simulate.simulate`'s; ``version``: their traces').

  Raises:
    ConfigError: for a layout with tensor-parallel stages.
    ProtocolError: when a segment's trace breaks a WSP guarantee (naming the segment and the first violations).
  """
  if any(vw.tp for vw in job.layout.vws):
    raise ConfigError("hetpipe: re-planning a layout with tensor-parallel stages is not built; give --adapt=off "
                      "or --tp=1")
  noise: Realisation | None = realise(job.options.noise, job.cluster)
  segments: list[Segment] = []
  start, layout, done, moved = 0.0, job.layout, 0, 0.0
  while done < job.waves:
    part = job._replace(layout=layout, waves=job.waves - done)
    network = Simulator(job.cluster, job.options.overlap_transfers, noise, start)
    watch = _Watch(part, costs, rule, network)
    trace = Trace(version=version)
    end, vws, rows = simulate(part, trace, meta, steady=watch, simulator=network)
    require_wsp(trace.events, f"re-planning run, layout {len(segments) + 1}")
    pushed = [vw.completed // vw.nm for vw in vws]
    segments.append(Segment(layout, start, end, sum(n * vw.nm for n, vw in zip(pushed, vws)), moved, trace, vws,
                            rows))
    done += min(pushed)
    if watch.replan is None:
      break
    moves = moved_bytes(job.profiles, layout, watch.replan, costs.optimizer_slots)
    moved = sum(m[2] for m in moves)
    start, layout = _move(job.cluster, moves, end, noise), watch.replan
  return segments


def segment_path(path: str, k: int) -> str:
  """Where segment ``k`` (from 0) of a re-planning run writes its trace: the trace path, then
  ``TRACE.layout2.jsonl``, ..."""
  return path if k == 0 else re.sub(r"(\.jsonl)?$", f".layout{k + 1}.jsonl", path, count=1)


def first_trace(segments: Sequence[Segment]) -> list[dict[str, Any]]:
  """The first segment's trace, its meta line listing every segment (``segments``: each layout's start, end,
  pushed minibatches, bytes moved before it, Nm and cuts)."""
  events = segments[0].trace.events
  events[0] = dict(events[0], segments=[{"start": s.start, "end": s.end, "minibatches": s.minibatches,
                                         "moved_bytes": s.moved_bytes, "nm": s.layout.nms, "cuts": s.layout.cuts}
                                        for s in segments])
  return events
