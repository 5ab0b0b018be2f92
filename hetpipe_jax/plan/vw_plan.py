"""A virtual worker's plan: its stages (GPU, units, time, memory) and its modelled speed.

A plan is the partitioner's answer (:mod:`~hetpipe_jax.plan.partition`), or a given GPU order and cuts
evaluated by :func:`vw_plan` (ED copies one plan onto every virtual worker this way). Stage time and
memory come from :func:`hetpipe_jax.cost.transfer.stage_seconds` and
:func:`hetpipe_jax.cost.memory.stage_memory_bytes`. A virtual worker's modelled throughput (docs/PROTOCOL.md
section 4) is min(1 / slowest stage, in flight / round trip) minibatches per second, where in flight is Nm,
or the window when one caps it (:mod:`hetpipe_jax.plan.layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext, degree_of
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.transfer import split_allreduce_seconds, stage_seconds
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.plan.layout import VWLayout
from hetpipe_jax.recompute import allowed_modes


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One stage of a planned virtual worker.

  Attributes:
    gpu: its GPU.
    first: its first unit.
    last: one past its last unit.
    seconds: forward + backward + boundary transfers, per minibatch.
    memory_bytes: what it needs on its GPU.
    recompute: its activation recomputation (:mod:`hetpipe_jax.recompute`).
  """

  gpu: Gpu
  first: int
  last: int
  seconds: float
  memory_bytes: int
  recompute: str = "none"


@dataclasses.dataclass(frozen=True)
class VWPlan:
  """How one virtual worker runs: GPU order, stages, Nm (and window), modelled speed (minibatches per
  second). Stage memory is for :attr:`in_flight` minibatches, per GPU of a stage that tensor parallelism splits
  over its ``tp`` partner GPUs (:class:`~hetpipe_jax.plan.layout.VWLayout`)."""

  nm: int
  stages: tuple[StagePlan, ...]
  window: int | None = None
  tp: tuple[tuple[Gpu, ...], ...] | None = None

  @property
  def in_flight(self) -> int:
    """The most minibatches in flight: the window, else Nm."""
    return self.nm if self.window is None else self.window

  @property
  def layout(self) -> VWLayout:
    """The virtual worker's GPUs, cuts, Nm, window and each stage's recomputation."""
    return VWLayout(tuple(self.gpus), tuple(self.cuts), self.nm, self.window,
                    tuple(s.recompute for s in self.stages), self.tp)

  def with_wave(self, nm: int) -> VWPlan:
    """This plan (its stages, memory and in-flight count) with waves of ``nm`` >= its in-flight count
    minibatches: a window caps what is in flight."""
    return VWPlan(nm, self.stages, None if nm == self.in_flight else self.in_flight, self.tp)

  @property
  def gpus(self) -> list[Gpu]:
    """The GPUs in pipeline order."""
    return [s.gpu for s in self.stages]

  @property
  def cuts(self) -> list[int]:
    """The cut positions ``(0, ..., num_units)``."""
    return [self.stages[0].first] + [s.last for s in self.stages]

  @property
  def bottleneck_s(self) -> float:
    """The slowest stage's seconds per minibatch."""
    return max(s.seconds for s in self.stages)

  @property
  def latency_s(self) -> float:
    """One minibatch's round trip through every stage, in seconds."""
    return sum(s.seconds for s in self.stages)

  @property
  def throughput(self) -> float:
    """Modelled minibatches per second: the slowest stage, or what is in flight over one round trip."""
    return min(1.0 / self.bottleneck_s, self.in_flight / self.latency_s)



def vw_plan(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu], cuts: Sequence[int],
            nm: int, costs: CostContext = DEFAULT_COSTS, window: int | None = None,
            tp: Sequence[Sequence[Gpu]] | None = None) -> VWPlan:
  """The plan of a virtual worker whose GPU order, cuts and Nm are given: each stage's recomputation, time and
  memory.

  Args:
    cluster: the cluster (links between the GPUs).
    profiles: per-unit profiles of the model.
    gpus: the GPUs in pipeline order.
    cuts: ``len(gpus) + 1`` cut positions from 0 to the number of units.
    nm: minibatches per wave (and in flight unless ``window`` is smaller).
    costs: what the memory of a stage holds (see stage_memory_bytes), the precision ("fp32", "fp16"
      or "bf16") of its time and memory, and the recomputation a stage may take (:func:`stage_recompute`).
    window: most minibatches in flight when fewer than Nm.
    tp: each stage's partner GPUs (tensor parallelism: its units' profiles split over them and itself, their
      all-reduces charged on the node's link), or None (one GPU per stage; ``profiles`` may then be split
      already, as the partitioner plans a split stage by its lead GPU, or split here by the degree
      ``costs.tp_by_type`` gives the stage's GPU type).

  Returns:
    The plan; nothing is checked against the GPUs' memory.
  """
  stages = []
  held = nm if window is None else window
  partners = tuple(tuple(p) for p in tp) if tp is not None and any(tp) else None
  for j in range(len(gpus)):
    degree = 1 + len(partners[j]) if partners is not None else degree_of(costs, gpus[j].type.name)
    mine = profiles if degree == 1 else [u.split(degree) for u in profiles]
    options = [_stage(cluster, mine, gpus, cuts, j, held, costs, mode) for mode in allowed_modes(costs.recompute)]
    stages.append(stage_recompute(options))
  return VWPlan(nm, tuple(stages), None if window == nm else window, partners)


def _stage(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Gpu], cuts: Sequence[int], j: int,
           held: int, costs: CostContext, mode: str) -> StagePlan:
  mine = list(profiles) if mode == "none" else [u.under(mode) for u in profiles]
  fwd, bwd = stage_seconds(cluster, mine, cuts, gpus, j, costs.precision)
  units = mine[cuts[j]:cuts[j + 1]]
  reduce = sum(sum(split_allreduce_seconds(cluster, u, costs.precision)) for u in units)
  return StagePlan(gpus[j], cuts[j], cuts[j + 1], fwd + bwd + reduce, stage_memory_bytes(units, held, costs), mode)


def stage_recompute(options: Sequence[StagePlan]) -> StagePlan:
  """The stage's plan under the recomputation it takes of ``options`` (one per allowed mode, least recomputation
  first): the fastest whose memory fits its GPU (the first of equals), else the one that needs the least memory
  (the memory check then names it)."""
  fits = [s for s in options if s.memory_bytes <= s.gpu.type.memory_bytes]
  if fits:
    return min(fits, key=lambda s: s.seconds)
  return min(options, key=lambda s: s.memory_bytes)
