"""What a run leaves: :class:`RunResult`."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetpipe_jax.core.worker import VirtualWorker


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
