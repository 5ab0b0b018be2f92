"""A virtual worker as the engine drives it: its pipeline schedule state, its weight versions, and the
numerics adapter that runs its tasks (or none).

The three concerns live apart: :mod:`~hetpipe_jax.core.schedule` says which task runs next,
:mod:`~hetpipe_jax.core.versions` which updates each stage's weights contain, and a :class:`Numerics`
computes (:class:`hetpipe_jax.runtime.numerics.pipeline.PipelineNumerics` on JAX devices; :class:`NoNumerics`
for the ``sim`` executor and schedule-only runs). This record only ties them to one virtual worker.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from hetpipe_jax.core import schedule as schedule_lib
from hetpipe_jax.core import versions as versions_lib
from hetpipe_jax.core.controls import PER_MINIBATCH, Control
from hetpipe_jax.core.schedule import Task


class Numerics(Protocol):
  """What runs a virtual worker's tasks."""

  @property
  def stages(self) -> Sequence[Any]:
    """The stage objects (empty without numerics)."""
    ...

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    """Minibatch ``mb`` enters stage 0 with inputs ``x`` (its ``labels`` go to the last stage)."""
    ...

  def run(self, task: Task) -> Any:
    """Dispatches ``task``; returns what to wait on for it to be done (None if nothing)."""
    ...

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    """Closes ``wave``: its summed updates by unit (what a push sends) and its minibatches' losses."""
    ...

  def take_skipped(self, wave: int) -> int:
    """After :meth:`take_wave`: how many of the wave's (stage, minibatch) updates were skipped by an fp16
    loss-scale overflow (0 without fp16)."""
    ...

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    """Pull: every stage <- the global weights of its units + its local updates not pushed yet.

    Returns, per stage, how many local updates it added back (``open_updates`` says how many it
    should have)."""
    ...

  def drop(self) -> None:
    """The virtual worker failed: forget its in-flight work and its updates not pushed yet."""
    ...

  def rejoin(self, params: Sequence[Any] | None) -> None:
    """A replacement starts: every stage <- the global weights of its units, a fresh local optimizer."""
    ...


class NoNumerics:
  """Schedules without computing: tasks take no device time, pushes carry no numbers."""

  def __init__(self, nm: int):
    self._nm = nm

  @property
  def stages(self) -> Sequence[Any]:
    return ()

  def inject(self, mb: int, x: Any, labels: Any) -> None:
    del mb, x, labels

  def run(self, task: Task) -> None:
    del task

  def take_wave(self, wave: int) -> tuple[dict[int, Any], list[Any]]:
    del wave
    return {}, [None] * self._nm

  def take_skipped(self, wave: int) -> int:
    del wave
    return 0

  def rebase(self, params: Sequence[Any] | None, open_updates: Sequence[int]) -> list[int]:
    del params
    return list(open_updates)

  def drop(self) -> None:
    pass

  def rejoin(self, params: Sequence[Any] | None) -> None:
    del params


@functools.lru_cache(maxsize=64)
def _no_numerics(nm: int) -> NoNumerics:
  """One :class:`NoNumerics` for every virtual worker of waves of ``nm`` (it holds nothing else: a task reads one
  object fewer of its own)."""
  return NoNumerics(nm)


@dataclasses.dataclass(slots=True)
class Progress:
  """What changes as a virtual worker runs: the engine's state holds it (a checkpoint saves it whole).

  Attributes:
    pipeline: the schedule state (a NamedTuple).
    versions: the weight versions of its stages (a NamedTuple).
    total_mbs: minibatches to run (fewer once the run stops injecting).
    live: False once it failed (and no replacement joined).
  """

  pipeline: schedule_lib.PipelineState
  versions: versions_lib.VersionBook
  total_mbs: int
  live: bool = True


class Shape(NamedTuple):
  """A virtual worker's shape where no layout gives one (a :class:`VWShape`): its stages, Nm and window."""

  k: int
  nm: int
  window: int | None = None


class VWShape(Protocol):
  """What a virtual worker's shape gives (:class:`hetpipe_jax.plan.layout.VWLayout` and :class:`Shape` do)."""

  @property
  def k(self) -> int: ...

  @property
  def nm(self) -> int: ...

  @property
  def window(self) -> int | None: ...


@dataclasses.dataclass(eq=False, slots=True)
class VirtualWorker:
  """One virtual worker: what it is, what runs its tasks, and its :class:`Progress`; :meth:`create`
  builds it fresh.

  Attributes:
    index: the virtual worker's index i.
    nm: minibatches per wave, and most minibatches in flight (>= 1) unless ``window`` is smaller.
    schedule: a key of :data:`hetpipe_jax.core.schedule.SCHEDULES`.
    weight_mode: "stash" (a backward uses its forward's weights) or "latest".
    numerics: what runs its tasks.
    progress: its schedule state, weight versions, minibatches to run and liveness (the engine's).
    window: most minibatches in flight when fewer than Nm (None: Nm).
    accumulate: minibatches per local update (its staleness control's, :mod:`hetpipe_jax.core.controls`; 1: one
      per minibatch).
  """

  index: int
  nm: int
  schedule: str
  weight_mode: str
  numerics: Numerics
  progress: Progress
  window: int | None = None
  accumulate: int = 1

  @classmethod
  def create(cls, index: int, shape: VWShape, total_mbs: int, num_vws: int, *, schedule: str = "1f1b",
             weight_mode: str = "stash", numerics: Numerics | None = None, accumulate: int = 1) -> VirtualWorker:
    """Virtual worker ``index`` of ``num_vws``, of ``shape.k`` stages, before its first minibatch."""
    progress = Progress(schedule_lib.init(shape.k, index), versions_lib.init(shape.k, num_vws), total_mbs)
    return cls(index, shape.nm, schedule, weight_mode, numerics or _no_numerics(shape.nm), progress, shape.window,
               accumulate)

  @property
  def pipeline(self) -> schedule_lib.PipelineState:
    return self.progress.pipeline

  @property
  def versions(self) -> versions_lib.VersionBook:
    return self.progress.versions

  @property
  def total_mbs(self) -> int:
    return self.progress.total_mbs

  @property
  def live(self) -> bool:
    return self.progress.live

  @property
  def k(self) -> int:
    return len(self.progress.pipeline.busy)

  @property
  def completed(self) -> int:
    return self.progress.pipeline.completed

  @property
  def done(self) -> bool:
    progress = self.progress
    return not progress.live or progress.pipeline.completed == progress.total_mbs

  @property
  def stages(self) -> Sequence[Any]:
    """The numerics' stage objects (empty without numerics)."""
    return self.numerics.stages


def virtual_workers(shapes: Sequence[VWShape], waves: int, schedule: str = "1f1b", weight_mode: str = "stash",
                    numerics: Sequence[Numerics] | None = None, control: Control = PER_MINIBATCH
                    ) -> list[VirtualWorker]:
  """One virtual worker per shape (its stages, Nm and window), each to run ``waves`` waves, with
  ``numerics`` (one per virtual worker; None: schedule only) and the staleness ``control``. Every executor builds
  its virtual workers here."""
  return [VirtualWorker.create(i, vw, waves * vw.nm, len(shapes), schedule=schedule, weight_mode=weight_mode,
                               numerics=None if numerics is None else numerics[i], accumulate=control.accumulate(vw.nm))
          for i, vw in enumerate(shapes)]
