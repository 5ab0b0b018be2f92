"""How the synchronous peers adapt to GPUs whose speed varies (issue 39, item 2): each re-sizes its workers'
work at every barrier from what the round just measured, as its authors do, never from the GPUs' true speeds.

What a worker measures is its *busy time* of the round: from the round's start to the end of its last local
step (its computing, its pipeline's bubbles and the waits on its own inputs; not the barrier, where it waits for
the others). A rule (:class:`~hetpipe_jax.baselines.sync.Rule`) turns the workers and their busy times into the
next round's workers; each peer names its own (its module says which):

* :class:`LocalSteps` (local SGD with H by speed: asynchronous local SGD's sizing from measured speed, DyLU,
  arXiv 2401.09135): each worker's speed is its local steps over its busy time; the fastest takes ``total`` local
  steps, every other its speed's share of them (at least 1), as the static rule does from the cost model.
* :class:`Microbatches` (synchronous pipelines: Metis and FlashFlex split an iteration's microbatches by speed;
  here re-split at every iteration from measured time): a pipeline of k stages takes about (m + k - 1) t for m
  microbatches (a flush's fill and drain), so each pipeline's t is its busy time over m + k - 1, and the
  iteration's ``total`` microbatches go one at a time to the pipeline that would finish them soonest (the split
  that minimises the slowest pipeline's modelled time; at least one each).
* hetero_dp's LB-BSP rule (Chen et al., arXiv 1806.02508) lives with its split,
  :class:`hetpipe_jax.baselines.hetero_dp.Rebalance`.

The round just measured decides the next (LB-BSP's rule for workers whose speed holds between barriers; its
predictor for volatile ones is not built). Re-sizing costs nothing on the network: which examples a worker reads
is its own choice, and nothing else moves.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.baselines.sync import Rule, Worker
from hetpipe_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LocalSteps(Rule):
  """H by measured speed (the fastest worker's H: ``total``)."""

  total: int
  name = "local_steps"

  def resize(self, workers: Sequence[Worker], busy: Sequence[float]) -> tuple[Worker, ...]:
    speeds = [w.local_steps / s for w, s in zip(workers, busy)]
    return tuple(dataclasses.replace(w, local_steps=max(1, round(self.total * v / max(speeds))))
                 for w, v in zip(workers, speeds))

  def shape(self, workers: Sequence[Worker]) -> dict[str, Any]:
    return {"rule": self.name, "local_steps": [w.local_steps for w in workers]}


@dataclasses.dataclass(frozen=True)
class Microbatches(Rule):
  """An iteration's ``total`` microbatches over the pipelines by measured time."""

  total: int
  name = "microbatches"

  def resize(self, workers: Sequence[Worker], busy: Sequence[float]) -> tuple[Worker, ...]:
    fill = [len(w.gpus) - 1 for w in workers]
    counts = least_slowest(self.total, fill, [s / (w.microbatches * w.local_steps + f)
                                              for w, s, f in zip(workers, busy, fill)])
    size = workers[0].batch // workers[0].microbatches  # (every microbatch of a pipeline worker: the batch size)
    return tuple(dataclasses.replace(w, batch=m * size, microbatches=m) for w, m in zip(workers, counts))

  def shape(self, workers: Sequence[Worker]) -> dict[str, Any]:
    return {"rule": self.name, "microbatches": [w.microbatches for w in workers]}


def least_slowest(total: int, fill: Sequence[int], per_item: Sequence[float]) -> list[int]:
  """``total`` items over workers that take ``(m + fill[i]) * per_item[i]`` for m, at least one each, one at a
  time to the worker that would finish soonest with it: the split that minimises the slowest worker's time (ties:
  the first worker).

  Raises:
    ConfigError: when ``total`` is smaller than the number of workers.
  """
  n = len(per_item)
  if total < n:
    raise ConfigError(f"{total} to split over {n} workers; give at least one each ({n})")
  counts = [1] * n
  heap = [((2 + f) * t, i) for i, (f, t) in enumerate(zip(fill, per_item))]
  heapq.heapify(heap)
  for _ in range(total - n):
    _, i = heapq.heappop(heap)
    counts[i] += 1
    heapq.heappush(heap, ((counts[i] + 1 + fill[i]) * per_item[i], i))
  return counts
