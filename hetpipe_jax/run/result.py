"""What a run leaves: :class:`RunResult`, and the config that ran (:func:`ran_config`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.run.config import RunConfig


@dataclasses.dataclass
class RunResult:
  """The global weights, the trace, the metrics and the timing of a run."""

  init_params: tuple[Any, ...] | None  # None for the sim executor (no numerics)
  params: tuple[Any, ...] | None
  events: list[dict[str, Any]]
  metrics: list[dict[str, Any]]
  seconds: float  # on the executor's clock
  wall_seconds: float  # host time the run took
  vws: list[VirtualWorker]
  cuts: list[list[int]]
  images: int  # in the waves pushed to the parameter server
  checkpoints: dict[str, Any] | None = None  # saved by this run: count, seconds and bytes each, resumed from
  fast_sim: dict[str, Any] | None = None  # the sim's fast mode: how the run was extrapolated

  @property
  def images_per_second(self) -> float:
    return self.images / self.seconds if self.seconds > 0 else float("nan")


def ran_config(config: RunConfig, result: RunResult) -> RunConfig:
  """``config`` with the layout that ran (the planner's, under a policy): its virtual workers' stages, Nm,
  windows and cuts, and a policy's virtual workers as the grouping of GPUs it chose (an explicit layout that
  runs the same again)."""
  meta = result.events[0]
  # a GPU's name in the meta line ends in its index in the cluster (hetpipe_jax.cluster.topology.Gpu.name)
  groups = tuple(tuple(int(g.rsplit(".", 1)[1]) for g in vw) for vw in meta["gpus"])
  return config.replace(
      num_vws=len(meta["stages"]), stages=tuple(meta["stages"]), nm=tuple(meta["nm"]),
      window=tuple(meta.get("window") or meta["nm"]), cuts=tuple(tuple(c) for c in result.cuts),
      policy=None if config.layout.policy is None else groups)
