"""A model's unit profiles at any batch size, from two profiled ones.

XLA's cost analysis of a unit is affine in the batch size: its flops are proportional to it, its bytes are
the weights' (read once, whatever the batch) plus the activations' (proportional), its output and kept
activations proportional, its parameters constant. So two profiles, at batch sizes b1 < b2, give every
other batch size by the line through them (exactly, where the analysis is affine; the peers of
:mod:`hetpipe_jax.baselines` that split a global batch unevenly over GPUs read their per-GPU costs here)::

  field(b) = field(b1) + (field(b2) - field(b1)) x (b - b1) / (b2 - b1)     (never below 0)

Built from a full-size model by name (:meth:`BatchProfiles.full_size`) or from any two profiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.cost.unit import Recomputed, UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.recompute import MODES, check_recompute

SCALED = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "out_bytes", "kept_bytes", "transient_bytes")


@dataclasses.dataclass(frozen=True)
class BatchProfiles:
  """Profiles at two batch sizes, and the line through them (see the module docstring).

  Attributes:
    low / high: the profiles at ``low_batch`` < ``high_batch`` (the same units, in order).
    low_batch / high_batch: their batch sizes.
  """

  low: tuple[UnitProfile, ...]
  high: tuple[UnitProfile, ...]
  low_batch: int
  high_batch: int
  _cache: dict[int, tuple[UnitProfile, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    if not 0 < self.low_batch < self.high_batch:
      raise ConfigError(f"batch profiles at batch sizes {self.low_batch} and {self.high_batch}; give two sizes "
                        "0 < b1 < b2")
    if [u.name for u in self.low] != [u.name for u in self.high]:
      raise ConfigError("batch profiles of different units; profile the same model at both batch sizes")

  @classmethod
  def full_size(cls, name: str, batch_size: int, seq_len: int | None = None) -> BatchProfiles:
    """A full-size model's (:data:`hetpipe_jax.models.FULL_SIZE`) at ``batch_size`` and twice it."""
    return cls(tuple(full_size_profiles(name, batch_size, seq_len=seq_len)),
               tuple(full_size_profiles(name, 2 * batch_size, seq_len=seq_len)), batch_size, 2 * batch_size)

  def at(self, batch_size: int) -> tuple[UnitProfile, ...]:
    """Every unit's profile at ``batch_size`` (>= 1).

    Raises:
      ConfigError: for a batch size below 1.
    """
    if batch_size < 1:
      raise ConfigError(f"batch size {batch_size}; profiles exist for batch sizes >= 1")
    if batch_size == self.low_batch:
      return self.low
    if batch_size == self.high_batch:
      return self.high
    found = self._cache.get(batch_size)
    if found is None:
      x = (batch_size - self.low_batch) / (self.high_batch - self.low_batch)
      found = self._cache[batch_size] = tuple(_unit_line(a, b, x) for a, b in zip(self.low, self.high))
    return found

  def under(self, mode: str) -> BatchProfiles:
    """These profiles with every unit under activation recomputation ``mode`` (none, selective or full: every
    GPU of a peer runs the same; :meth:`hetpipe_jax.cost.unit.UnitProfile.under`).

    Raises:
      ConfigError: for another mode.
    """
    if check_recompute(mode, MODES) == "none":
      return self
    return BatchProfiles(tuple(u.under(mode) for u in self.low), tuple(u.under(mode) for u in self.high),
                         self.low_batch, self.high_batch)


def _line(a: float, b: float, x: float):
  value = max(a + (b - a) * x, 0.0)
  return int(round(value)) if isinstance(a, int) else value


def _unit_line(a: UnitProfile, b: UnitProfile, x: float) -> UnitProfile:
  """The unit's profile at ``x`` along the line from ``a`` (x = 0) to ``b`` (x = 1), its recomputation costs
  and its tensor-parallel activations with it (every one of their fields is batch-dependent)."""
  modes = {m: None if ra is None or rb is None else Recomputed(_line(ra.bwd_flops, rb.bwd_flops, x),
                                                               _line(ra.bwd_bytes, rb.bwd_bytes, x),
                                                               int(_line(ra.kept_bytes, rb.kept_bytes, x)))
           for m, ra, rb in (("selective", a.selective, b.selective), ("full", a.full, b.full))}
  tp = None if a.tp is None or b.tp is None else a.tp._replace(
      in_bytes=int(_line(a.tp.in_bytes, b.tp.in_bytes, x)),
      whole_kept_bytes=int(_line(a.tp.whole_kept_bytes, b.tp.whole_kept_bytes, x)))
  eager = (None if a.eager_kept_bytes is None or b.eager_kept_bytes is None
           else int(_line(a.eager_kept_bytes, b.eager_kept_bytes, x)))
  return dataclasses.replace(a, **{f: _line(getattr(a, f), getattr(b, f), x) for f in SCALED}, **modes, tp=tp,
                             eager_kept_bytes=eager)


def _doubled(u: UnitProfile) -> UnitProfile:
  """``u`` with every batch-dependent cost doubled (its recomputation costs and tensor-parallel activations
  too)."""
  modes = {m: None if r is None else Recomputed(2 * r.bwd_flops, 2 * r.bwd_bytes, 2 * r.kept_bytes)
           for m, r in (("selective", u.selective), ("full", u.full))}
  tp = None if u.tp is None else u.tp._replace(in_bytes=2 * u.tp.in_bytes,
                                               whole_kept_bytes=2 * u.tp.whole_kept_bytes)
  eager = None if u.eager_kept_bytes is None else 2 * u.eager_kept_bytes
  return dataclasses.replace(u, **{f: getattr(u, f) * 2 for f in SCALED}, **modes, tp=tp, eager_kept_bytes=eager)


def fixed(profiles: Sequence[UnitProfile], batch_size: int) -> BatchProfiles:
  """Profiles known at one batch size only, scaled in proportion (every batch-dependent field x b / b0):
  for hand-made profiles (tests) whose costs are all per-example."""
  doubled = tuple(_doubled(u) for u in profiles)
  return BatchProfiles(tuple(profiles), doubled, batch_size, 2 * batch_size)
