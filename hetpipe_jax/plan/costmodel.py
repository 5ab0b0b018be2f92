"""A layout's costs on a cluster: every task's duration (the virtual clock and the simulator) and the
memory check of every stage (docs/PROTOCOL.md section 4).

Task time of stage j = its units' roofline time on its GPU (:mod:`hetpipe_jax.cost.roofline`) plus
receiving its boundary tensor alone on the link from its neighbour (:mod:`hetpipe_jax.cost.transfer`):
the activation from stage j-1 before a forward, the gradient from stage j+1 before a backward. A stage split
over several GPUs by tensor parallelism computes its units' per-GPU share (:meth:`UnitProfile.split`) and adds
its all-reduces, each alone on its node's link (a ring); the simulator's network carries them on that link,
shared with whatever else crosses it (:meth:`CostModel.allreduce_flow`). Memory of a stage:
:func:`hetpipe_jax.cost.memory.stage_memory_bytes`, per GPU. Both O(units) per stage, computed once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu, format_bytes
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.roofline import model_compute_seconds, stage_compute_seconds
from hetpipe_jax.cost.transfer import stage_allreduce_flows, stage_allreduce_seconds, stage_transfers, with_receives
from hetpipe_jax.cost.unit import UnitProfile, under_modes
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout


class CostModel:
  """Task durations of every (virtual worker, stage) of a layout on a cluster.

  Args:
    cluster: the cluster (links).
    all_profiles: per-unit profile of the model (each virtual worker's stages take it under their
      recomputation, :func:`vw_profiles`).
    layout: the run's layout (GPUs in pipeline order and cuts of every virtual worker).
    precision: "fp32", "fp16" or "bf16".
  """

  def __init__(self, cluster: Cluster, all_profiles: Sequence[UnitProfile], layout: Layout,
               precision: str = "fp32"):
    self._seconds: dict[tuple[int, int, str], float] = {}
    self._compute: dict[tuple[int, int, str], float] = {}
    self._transfer: dict[tuple[int, int, str], tuple[int, Gpu, Gpu] | None] = {}
    self._flow: dict[tuple[int, int, str], tuple[float, float, int]] = {}
    self._gpus = {(i, j): vw.stage_gpus(j) for i, vw in enumerate(layout.vws) for j in range(vw.k)}
    # a stage's units on its GPU type, by (first unit, end, type): replicated virtual workers share them (the
    # profiles of one under recomputation or tensor parallelism are its own, computed for it)
    units_cost: dict[tuple[int, int, int], tuple] = {}
    for i, vw in enumerate(layout.vws):
      cut, group, profiles = vw.cuts, vw.gpus, vw_profiles(all_profiles, vw)
      for j in range(vw.k):
        shape = (cut[j], cut[j + 1], id(group[j].type))  # (the cluster holds its types meanwhile)
        found = units_cost.get(shape) if profiles is all_profiles else None
        if found is None:
          units = profiles[cut[j]:cut[j + 1]]  # (split by the stage's degree)
          found = (stage_compute_seconds(profiles, cut, group[j], j, precision),
                   stage_allreduce_seconds(cluster, units, precision), stage_allreduce_flows(cluster, units, precision))
          if profiles is all_profiles:
            units_cost[shape] = found
        compute, reduce, flows = found
        transfers = stage_transfers(profiles, cut, group, j, precision)
        seconds = with_receives(cluster, compute, transfers, group[j])  # (stage_seconds, its compute shared)
        for kind, c, recv, t, r, (num_bytes, latency) in zip(("fwd", "bwd"), compute, transfers, seconds, reduce,
                                                             flows):
          key = (i, j, kind)
          self._compute[key] = c + r
          self._transfer[key] = None if recv is None else (recv.num_bytes, recv.src, group[j])
          self._seconds[key] = t + r
          if num_bytes:  # (the flow's own latency is the network's)
            self._flow[key] = (c + latency - cluster.intra_node.latency_s, num_bytes, group[j].node)

  def task_seconds(self, vw: int, stage: int, kind: str) -> float:
    """Seconds of a task: compute plus receiving its input alone on its link.

    Args:
      vw: the virtual worker.
      stage: the stage.
      kind: "fwd" or "bwd".

    Returns:
      Seconds.
    """
    return self._seconds[(vw, stage, kind)]

  def compute_seconds(self, vw: int, stage: int, kind: str) -> float:
    """Seconds of a task's compute alone, without receiving its input.

    Args:
      vw / stage / kind: as for :meth:`task_seconds`.

    Returns:
      Seconds.
    """
    return self._compute[(vw, stage, kind)]

  def stage_gpus(self, vw: int, stage: int) -> tuple[Gpu, ...]:
    """The GPUs a stage's tasks run on: its own, then its tensor-parallel partners."""
    return self._gpus[(vw, stage)]

  def allreduce_flow(self, vw: int, stage: int, kind: str) -> tuple[float, float, int] | None:
    """A split stage's task as the simulator's network runs it: (seconds of compute and of its all-reduces'
    latencies but one, the bytes its all-reduces move on its node's link as one flow, that node); None for a
    stage on one GPU. Alone on the link, the two take :meth:`compute_seconds`.

    Args:
      vw / stage / kind: as for :meth:`task_seconds`.
    """
    return self._flow.get((vw, stage, kind))

  def transfer(self, vw: int, stage: int, kind: str) -> tuple[int, Gpu, Gpu] | None:
    """What a task must receive before it computes.

    Args:
      vw / stage / kind: as for :meth:`task_seconds`.

    Returns:
      (bytes, from GPU, to GPU), or None when nothing crosses a link.
    """
    return self._transfer[(vw, stage, kind)]


def check_memory(profiles: Sequence[UnitProfile], layout: Layout, costs: CostContext = DEFAULT_COSTS) -> None:
  """Checks that every stage of ``layout`` fits its GPU's memory.

  Args:
    profiles: per-unit profiles of the model.
    layout: the run's layout.
    costs: what a stage holds (:func:`hetpipe_jax.cost.memory.param_copies`).

  Raises:
    ConfigError: naming the first stage that does not fit, its need, the GPU's memory and the fixes.
  """
  for i, vw in enumerate(layout.vws):
    mine = vw_profiles(profiles, vw)
    for j, gpu, units in vw.stages():
      need = stage_memory_bytes(mine[units.start:units.stop], vw.in_flight, costs)
      if need > gpu.type.memory_bytes:
        held = f"Nm={vw.nm}" if vw.window is None else f"window={vw.window} (Nm={vw.nm})"
        raise ConfigError(
            f"stage {j} of virtual worker {i} (units {units.start}..{units.stop - 1}) needs "
            f"{format_bytes(need)} with {held} in flight ({costs.weight_mode}, recompute="
            f"{vw.stage_recompute(j)}), but GPU {gpu.name} has {format_bytes(gpu.type.memory_bytes)}; use more "
            "stages, a smaller Nm, window or batch size, weight_mode=latest, recompute=full or auto, or a cluster "
            "with more memory")


def vw_profiles(profiles: Sequence[UnitProfile], vw: VWLayout) -> Sequence[UnitProfile]:
  """The profiles a virtual worker's units run at: each under its stage's recomputation, per GPU of its stage's
  tensor-parallel degree."""
  mine = profiles if vw.recompute is None else under_modes(profiles, vw.unit_recompute())
  if vw.tp is None:
    return mine
  degrees = [vw.degree(j) for j in range(vw.k) for _ in vw.stage_units(j)]
  return [u.split(t) for u, t in zip(mine, degrees)]


def standalone_images_per_sec(profiles: Sequence[UnitProfile], gpu: Gpu, batch_size: int,
                              precision: str = "fp32") -> float:
  """One GPU training the whole model alone (memory ignored): batch / (forward + backward of every unit)."""
  return batch_size / model_compute_seconds(profiles, gpu.type, precision)


def ideal_images_per_sec(cluster: Cluster, profiles: Sequence[UnitProfile], batch_size: int,
                         gpus: Sequence[Gpu] | None = None, precision: str = "fp32") -> float:
  """The ideal heterogeneous aggregate: the sum over ``gpus`` (default: every GPU of the cluster) of each
  one's standalone training rate on the model, memory ignored (issue 11's yardstick)."""
  return sum(standalone_images_per_sec(profiles, g, batch_size, precision) for g in (gpus or cluster.gpus))
