"""A layout's costs on a cluster: every task's duration (the virtual clock and the simulator) and the
memory check of every stage.

Task time of stage j = its units' roofline time on its GPU (:mod:`hetpipe_jax.cost.profile`) plus
receiving its boundary tensor over the link from its neighbour: the activation from stage j-1 before a
forward, the gradient from stage j+1 before a backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu, format_bytes
from hetpipe_jax.cost.profile import UnitProfile, stage_compute_seconds, stage_memory_bytes, stage_transfers
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout


class CostModel:
  """Task durations of every (virtual worker, stage) of a layout on a cluster.

  Args:
    cluster: the cluster (links).
    profiles: per-unit profile of the model.
    layout: the run's layout (GPUs in pipeline order and cuts of every virtual worker).
  """

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout,
               precision: str = "fp32"):
    self._seconds: dict[tuple[int, int, str], float] = {}
    self._compute: dict[tuple[int, int, str], float] = {}
    self._transfer: dict[tuple[int, int, str], tuple[int, Gpu, Gpu] | None] = {}
    for i, vw in enumerate(layout.vws):
      cut, group = vw.cuts, vw.gpus
      for j in range(vw.k):
        compute = stage_compute_seconds(profiles, cut, group[j], j, precision)
        transfers = stage_transfers(profiles, cut, group, j)
        for kind, c, recv in zip(("fwd", "bwd"), compute, transfers):
          key = (i, j, kind)
          self._compute[key] = c
          self._transfer[key] = None if recv is None else (recv[0], recv[1], group[j])
          self._seconds[key] = c + (0.0 if recv is None else
                                    cluster.transfer_seconds(recv[1], group[j], recv[0]))

  def task_seconds(self, vw: int, stage: int, kind: str) -> float:
    """Compute plus receiving the task's input alone on its link."""
    return self._seconds[(vw, stage, kind)]

  def compute_seconds(self, vw: int, stage: int, kind: str) -> float:
    return self._compute[(vw, stage, kind)]

  def transfer(self, vw: int, stage: int, kind: str) -> tuple[int, Gpu, Gpu] | None:
    """(bytes, from GPU, to GPU) the task must receive before it computes, or None."""
    return self._transfer[(vw, stage, kind)]


def check_memory(profiles: Sequence[UnitProfile], layout: Layout, weight_mode: str,
                 optimizer_slots: float) -> None:
  """Raises ConfigError naming the first stage of ``layout`` that does not fit its GPU's memory."""
  for i, vw in enumerate(layout.vws):
    for j, gpu, units in vw.stages():
      need = stage_memory_bytes(profiles[units.start:units.stop], vw.nm, weight_mode, optimizer_slots)
      if need > gpu.type.memory_bytes:
        raise ConfigError(
            f"stage {j} of virtual worker {i} (units {units.start}..{units.stop - 1}) needs "
            f"{format_bytes(need)} with Nm={vw.nm} ({weight_mode}), but GPU {gpu.name} has "
            f"{format_bytes(gpu.type.memory_bytes)}; use more stages, a smaller Nm or batch size, "
            "weight_mode=latest, or a cluster with more memory")
