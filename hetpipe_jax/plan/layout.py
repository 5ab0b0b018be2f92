"""The shape of a run: for every virtual worker its GPUs in pipeline order, its cuts, its Nm (and window).

One frozen value travels from whoever decides the shape (the partitioner and allocation policies, or a
user's ``--stages``/``--cuts``) to everything that needs it: the cost model, the memory check, the
simulator, the PS placement, the runtime and the trace's meta line. No parallel lists::

  layout = Layout((VWLayout(gpus=(g0, g1), cuts=(0, 2, 5), nm=2),
                   VWLayout(gpus=(g2,), cuts=(0, 5), nm=1)))
  layout.vws[0].stage_units(1)     # range(2, 5): the units of stage 1 of virtual worker 0
  layout.meta()                    # the trace's layout fields: num_vws, nm, stages, cuts, gpus

Cuts are unit boundaries ``(0, c_1, ..., num_units)``: stage j holds units ``cuts[j] .. cuts[j+1]-1``.

Nm is a virtual worker's wave (minibatches per push) and, by default, its most minibatches in flight. A
*window* W < Nm caps the minibatches in flight at W while the wave stays Nm: memory (kept activations,
stashed weights) grows with what is in flight, so a virtual worker that holds few minibatches still runs
waves long enough to keep pace with faster ones under WSP. Every WSP guarantee is stated for Nm and still
holds (injection is only stricter). The trace's meta line carries ``window`` only when one is set, and
``recompute`` (each stage's activation recomputation, :mod:`hetpipe_jax.recompute`) only when a stage recomputes,
and ``tp`` (each stage's tensor-parallel partner GPUs, :mod:`hetpipe_jax.tensor`) only when a stage has some.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from hetpipe_jax.cluster import Gpu
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.recompute import MODES, check_recompute


def per_vw(name: str, value: int | Sequence[int], n: int) -> list[int]:
  """``value`` for each of ``n`` virtual workers: one value for all, or a sequence of ``n``.

  Raises:
    ConfigError: when a sequence has another length.
  """
  values = [value] * n if isinstance(value, int) else list(value)
  if len(values) != n:
    raise ConfigError(f"{name} has {len(values)} values {values} for {n} virtual workers; give one "
                      "value, or one per virtual worker")
  return values


@dataclasses.dataclass(frozen=True)
class VWLayout:
  """One virtual worker: its GPUs in pipeline order, the unit boundaries of its stages, its Nm.

  Attributes:
    gpus: the GPU of each stage, stage 0 first.
    cuts: ``len(gpus) + 1`` unit boundaries from 0 to the model's unit count.
    nm: minibatches per wave, and most minibatches in flight unless ``window`` is smaller (>= 1).
    window: most minibatches in flight, 1 <= window < nm (None: Nm; a window equal to Nm is stored as None).
    recompute: each stage's activation recomputation (:mod:`hetpipe_jax.recompute`: "none", "selective" or
      "full"); None: "none" for every stage (stored so when every stage is "none").
    tp: each stage's partner GPUs, those tensor parallelism splits it over beside its own
      (:mod:`hetpipe_jax.tensor`): GPUs of its GPU's node and type; None: none for any stage (stored so when no
      stage has any).
  """

  gpus: tuple[Gpu, ...]
  cuts: tuple[int, ...]
  nm: int
  window: int | None = None
  recompute: tuple[str, ...] | None = None
  tp: tuple[tuple[Gpu, ...], ...] | None = None

  def __post_init__(self):
    object.__setattr__(self, "gpus", tuple(self.gpus))
    object.__setattr__(self, "cuts", tuple(int(c) for c in self.cuts))
    if len(self.cuts) != len(self.gpus) + 1:
      raise ConfigError(f"cuts {list(self.cuts)} give {len(self.cuts) - 1} stages for {len(self.gpus)} "
                        f"GPUs; give {len(self.gpus) + 1} boundaries")
    self._check_recompute()
    self._check_tp()
    if self.window is not None:
      if not 1 <= self.window <= self.nm:
        raise ConfigError(f"window={self.window} with Nm={self.nm}; the window (most minibatches in flight) "
                          f"must be between 1 and Nm={self.nm}")
      if self.window == self.nm:
        object.__setattr__(self, "window", None)

  def _check_recompute(self) -> None:
    if self.recompute is None:
      return
    modes = tuple(check_recompute(m, MODES) for m in self.recompute)
    if len(modes) != len(self.gpus):
      raise ConfigError(f"recompute {list(modes)} gives {len(modes)} modes for {len(self.gpus)} stages; give one "
                        "per stage")
    object.__setattr__(self, "recompute", None if set(modes) == {"none"} else modes)

  def _check_tp(self) -> None:
    if self.tp is None:
      return
    tp = tuple(tuple(partners) for partners in self.tp)
    if len(tp) != len(self.gpus):
      raise ConfigError(f"tp gives partner GPUs for {len(tp)} stages of {len(self.gpus)}; give one tuple per stage")
    for j, (gpu, partners) in enumerate(zip(self.gpus, tp)):
      odd = [g.name for g in partners if g.node != gpu.node or g.type != gpu.type]
      if odd:
        raise ConfigError(f"stage {j} on {gpu.name} is split over {odd}, not GPUs of its node and type; tensor "
                          "parallelism splits a stage over GPUs of one type in one node")
    used = [g.index for j in range(len(self.gpus)) for g in (self.gpus[j], *tp[j])]
    if len(set(used)) != len(used):
      raise ConfigError(f"GPUs {used} of a virtual worker's stages and their partners hold a GPU twice; give each "
                        "GPU to one stage")
    object.__setattr__(self, "tp", tp if any(tp) else None)

  def stage_gpus(self, j: int) -> tuple[Gpu, ...]:
    """Stage ``j``'s GPUs: its own, then those tensor parallelism splits it over."""
    return (self.gpus[j],) if self.tp is None else (self.gpus[j], *self.tp[j])

  def degree(self, j: int) -> int:
    """Stage ``j``'s tensor-parallel degree: the GPUs it is split over (1: its own alone)."""
    return len(self.stage_gpus(j))

  @property
  def in_flight(self) -> int:
    """The most minibatches in flight: the window, else Nm."""
    return self.nm if self.window is None else self.window

  def stage_recompute(self, j: int) -> str:
    """Stage ``j``'s activation recomputation."""
    return "none" if self.recompute is None else self.recompute[j]

  def unit_recompute(self) -> list[str]:
    """Every unit's activation recomputation: its stage's."""
    return [self.stage_recompute(j) for j in range(self.k) for _ in self.stage_units(j)]

  @property
  def k(self) -> int:
    """The number of stages (= GPUs)."""
    return len(self.gpus)

  @property
  def num_units(self) -> int:
    return self.cuts[-1]

  def stage_units(self, j: int) -> range:
    """The units of stage ``j``."""
    return range(self.cuts[j], self.cuts[j + 1])

  def stages(self) -> Iterator[tuple[int, Gpu, range]]:
    """``(j, gpu, units)`` for every stage, in pipeline order."""
    for j, gpu in enumerate(self.gpus):
      yield j, gpu, self.stage_units(j)

  def stage_of_unit(self, unit: int) -> int:
    """The stage that holds ``unit``."""
    return next(j for j in range(self.k) if self.cuts[j] <= unit < self.cuts[j + 1])


@dataclasses.dataclass(frozen=True)
class Layout:
  """Every virtual worker of a run (see the module docstring)."""

  vws: tuple[VWLayout, ...]

  def __post_init__(self):
    object.__setattr__(self, "vws", tuple(self.vws))
    if not self.vws:
      raise ConfigError("a layout needs at least 1 virtual worker")

  @property
  def num_vws(self) -> int:
    return len(self.vws)

  @property
  def nms(self) -> list[int]:
    return [vw.nm for vw in self.vws]

  @property
  def windows(self) -> list[int] | None:
    """Most minibatches in flight per virtual worker, or None when every one runs Nm in flight."""
    if all(vw.window is None for vw in self.vws):
      return None
    return [vw.in_flight for vw in self.vws]

  @property
  def stages(self) -> list[int]:
    return [vw.k for vw in self.vws]

  @property
  def cuts(self) -> list[list[int]]:
    return [list(vw.cuts) for vw in self.vws]

  @property
  def gpus(self) -> list[list[Gpu]]:
    return [list(vw.gpus) for vw in self.vws]

  @property
  def num_gpus(self) -> int:
    """Every GPU the layout uses: each stage's, and its tensor-parallel partners."""
    return sum(vw.degree(j) for vw in self.vws for j in range(vw.k))

  def with_cuts(self, cuts) -> Layout:
    """The same GPUs, Nm and windows with other cuts (one boundary list per virtual worker)."""
    return Layout(tuple(dataclasses.replace(vw, cuts=tuple(c)) for vw, c in zip(self.vws, cuts)))

  def with_windows(self, window: int | Sequence[int] | None) -> Layout:
    """The same layout with at most ``window`` minibatches in flight (one value, or one per virtual
    worker; None: Nm).

    Raises:
      ConfigError: for a count that is not one or one per virtual worker, or a window outside 1..Nm.
    """
    if window is None:
      return self
    if not isinstance(window, int) and len(window) == 1:  # one value in a list serves every one too
      window = window[0]
    windows = per_vw("window", window, self.num_vws)
    return Layout(tuple(dataclasses.replace(vw, window=int(w)) for vw, w in zip(self.vws, windows)))

  def meta(self) -> dict[str, Any]:
    """The layout fields of a trace's meta line (``window`` only when one is set)."""
    out = {"num_vws": self.num_vws, "nm": self.nms, "stages": self.stages, "cuts": self.cuts,
           "gpus": [[g.name for g in vw.gpus] for vw in self.vws]}
    if any(vw.recompute is not None for vw in self.vws):
      out["recompute"] = [[vw.stage_recompute(j) for j in range(vw.k)] for vw in self.vws]
    if any(vw.tp is not None for vw in self.vws):
      out["tp"] = [[[g.name for g in vw.stage_gpus(j)[1:]] for j in range(vw.k)] for vw in self.vws]
    return out if self.windows is None else {**out, "window": self.windows}

