"""A virtual worker: k stages on k devices running minibatches as an asynchronous pipeline.

HETPIPE.md section 2: minibatches p = 1, 2, ... are injected in order, p only once p - Nm has completed
(its backward at stage 0 is done); each device runs one task at a time and, among ready tasks, prefers a
backward over a forward (``1f1b``, then lowest minibatch) or takes them in the order they became ready
(``fifo``). The schedule is data: :meth:`VirtualWorker.pop_task` picks, the engine decides when.

Task graph of minibatch p on k stages::

  fwd(0,p) -> fwd(1,p) -> ... -> fwd(k-1,p) -> bwd(k-1,p) -> ... -> bwd(0,p) -> complete(p)

The worker also keeps the *version* of each stage's weights, with or without numerics: ``own`` (own
minibatch updates included) and ``glob`` (waves of each virtual worker in the global base). The trace
reports it and the checker verifies it. With numerics, a rebase counts the updates the stage really
added back, so a rebase that loses updates shows in the trace. With ``stages=None`` the worker only
schedules (the cost-model-only path).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Any, NamedTuple

import jax

from hetpipe_jax.core import wsp
from hetpipe_jax.runtime.stage import Stage

SCHEDULES = ("1f1b", "fifo")


class Version(NamedTuple):
  """Which updates a set of stage weights contains."""

  own: int  # own minibatch updates
  glob: tuple[int, ...]  # waves of each virtual worker in the global base


@dataclasses.dataclass(eq=False)
class Task:
  """One forward or backward pass of one minibatch on one stage."""

  vw: int
  stage: int
  kind: str  # "fwd" | "bwd"
  mb: int
  t0: float = 0.0
  version: Version | None = None
  out: Any = None  # arrays to wait on for the task to be done (wall executor)


class VirtualWorker:
  """Pipeline state of one virtual worker.

  Args:
    index: the virtual worker's index i.
    num_stages: k.
    nm: most minibatches in flight (>= 1).
    total_mbs: minibatches to run.
    num_vws: number of virtual workers (length of ``Version.glob``).
    schedule: "1f1b" (backward first) or "fifo".
    weight_mode: "stash" (a backward uses its forward's weights) or "latest".
    stages: the k :class:`Stage` objects, or None to schedule without numerics.
  """

  def __init__(self, index: int, num_stages: int, nm: int, total_mbs: int, num_vws: int,
               schedule: str = "1f1b", weight_mode: str = "stash", stages: list[Stage] | None = None):
    self.index, self.k, self.nm, self.total_mbs = index, num_stages, nm, total_mbs
    self.schedule, self.weight_mode, self.stages = schedule, weight_mode, stages
    self.versions = [Version(0, (0,) * num_vws)] * num_stages
    self._open_waves: list[dict[int, int]] = [{} for _ in range(num_stages)]  # wave -> updates applied
    self._fwd_versions: dict[tuple[int, int], Version] = {}
    self.next_mb = 1  # next minibatch to inject
    self.completed = 0  # minibatches completed, in order
    self.busy: list[Task | None] = [None] * num_stages
    self._ready: list[list] = [[] for _ in range(num_stages)]
    self._seq = itertools.count()
    self._data: dict[tuple[int, int], Any] = {}  # (stage, mb) -> input of that stage's next task
    self._labels: dict[int, Any] = {}
    self.losses: dict[int, Any] = {}  # mb -> loss (device scalar), until the wave is recorded
    self.waiting_since: float | None = None  # gate closed since then

  # --- schedule --------------------------------------------------------------------------------------

  @property
  def done(self) -> bool:
    return self.completed == self.total_mbs

  def can_inject(self) -> bool:
    return self.next_mb <= self.total_mbs and self.next_mb - self.nm <= self.completed

  def _make_ready(self, stage: int, kind: str, mb: int) -> None:
    key = (kind == "fwd", mb) if self.schedule == "1f1b" else (next(self._seq),)
    heapq.heappush(self._ready[stage], (key, Task(self.index, stage, kind, mb)))

  def has_work(self, stage: int) -> bool:
    return self.busy[stage] is None and bool(self._ready[stage])

  def pop_task(self, stage: int) -> Task | None:
    """The task ``stage``'s device runs next, or None if it is busy or has nothing ready."""
    if not self.has_work(stage):
      return None
    task = heapq.heappop(self._ready[stage])[1]
    self.busy[stage] = task
    return task

  def inject(self, x=None, labels=None) -> int:
    """Injects the next minibatch (the caller checked the window and the gate); returns its number."""
    mb = self.next_mb
    self.next_mb += 1
    if self.stages is not None:
      self._data[(0, mb)] = jax.device_put(x, self.stages[0].device)
      self._labels[mb] = jax.device_put(labels, self.stages[-1].device)
    self._make_ready(0, "fwd", mb)
    return mb

  def finish(self, task: Task) -> bool:
    """Marks ``task`` done and readies its successor; returns True when it completed its minibatch."""
    self.busy[task.stage] = None
    j, mb = task.stage, task.mb
    if task.kind == "fwd":
      if j + 1 < self.k:
        self._make_ready(j + 1, "fwd", mb)
      else:
        self._make_ready(j, "bwd", mb)
      return False
    if j > 0:
      self._make_ready(j - 1, "bwd", mb)
      return False
    if mb != self.completed + 1:
      raise RuntimeError(f"VW {self.index}: minibatch {mb} completed before {self.completed + 1}")
    self.completed = mb
    return True

  # --- numerics --------------------------------------------------------------------------------------

  def run(self, task: Task) -> None:
    """Starts ``task``: records the weight version it uses and dispatches its numerics (``task.out``).

    A backward applies its update at once, so the stage's version counts it from here on.
    """
    j, mb = task.stage, task.mb
    if task.kind == "fwd":
      task.version = self.versions[j]
      self._fwd_versions[(j, mb)] = task.version
    else:
      fwd_version = self._fwd_versions.pop((j, mb))
      task.version = fwd_version if self.weight_mode == "stash" else self.versions[j]
      self.versions[j] = self.versions[j]._replace(own=self.versions[j].own + 1)
      wave = wsp.wave_of(mb, self.nm)
      self._open_waves[j][wave] = self._open_waves[j].get(wave, 0) + 1
    if self.stages is None:
      return
    stage = self.stages[j]
    if task.kind == "fwd":
      x = self._data.pop((j, mb))
      if j > 0:  # the activation comes from the previous stage's device
        x = jax.device_put(x, stage.device)
      task.out = stage.forward(mb, x, self._labels.pop(mb) if stage.is_last else None)
      if stage.is_last:
        self.losses[mb] = task.out
      else:
        self._data[(j + 1, mb)] = task.out
      return
    g = None if stage.is_last else jax.device_put(self._data.pop((j + 1, mb)), stage.device)
    gx = stage.backward(mb, g)
    if j > 0:
      self._data[(j, mb)] = gx
    task.out = stage.params

  def warm_up(self, x, labels) -> None:
    """Compiles every stage program on a minibatch shaped like ``x`` before the clock starts."""
    for stage in self.stages or ():
      x = stage.warm_up(x, jax.device_put(labels, stage.device) if stage.is_last else None)

  def rebase(self, snapshot_params, waves: tuple[int, ...]) -> None:
    """Pull: rebases every stage on the global weights (one entry per unit) that contain ``waves``.

    The new version counts the own updates inside the global base (the waves this VW pushed) plus the
    local updates the stage added back on top.
    """
    for j in range(self.k):
      if self.stages is None:
        added = sum(self._open_waves[j].values())
      else:
        stage = self.stages[j]
        added = stage.rebase(snapshot_params[stage.first:stage.last])
      self.versions[j] = Version(waves[self.index] * self.nm + added, tuple(waves))

  def take_wave(self, wave: int) -> dict[int, Any]:
    """Closes a finished wave; returns its summed updates keyed by unit index (what a push sends)."""
    for j in range(self.k):
      count = self._open_waves[j].pop(wave, 0)
      if count != self.nm:
        raise RuntimeError(f"VW {self.index} stage {j}: wave {wave} has {count} updates, expected "
                           f"Nm={self.nm}")
    updates = {}
    for stage in self.stages or ():
      for unit, update in zip(range(stage.first, stage.last), stage.take_wave(wave)):
        updates[unit] = update
    return updates
