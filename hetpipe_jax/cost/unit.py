"""The cost profile of one unit (docs/PROTOCOL.md section 4): plain data, what every cost model reads.

Measured by :mod:`~hetpipe_jax.cost.profile`; timed by :mod:`~hetpipe_jax.cost.roofline`
(:func:`~hetpipe_jax.cost.roofline.unit_seconds`), sized by :mod:`~hetpipe_jax.cost.memory`, sent by
:mod:`~hetpipe_jax.cost.transfer`. Imports nothing of the package but its errors and the names of the recomputation
modes (:mod:`hetpipe_jax.recompute`), so each of them can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.recompute import MODES, check_recompute


class Recomputed(NamedTuple):
  """A unit's backward pass under one activation recomputation (:mod:`hetpipe_jax.recompute`).

  Attributes:
    bwd_flops / bwd_bytes: of the backward pass with the recomputed forward in it.
    kept_bytes: activation memory kept for the backward pass under the mode.
  """

  bwd_flops: float
  bwd_bytes: float
  kept_bytes: int


@dataclasses.dataclass(frozen=True)
class UnitProfile:
  """Cost of one unit at one batch size.

  Attributes:
    name: the unit's name.
    fwd_flops / bwd_flops: floating-point operations of the forward / backward pass.
    fwd_bytes / bwd_bytes: bytes of memory they access.
    param_bytes: the unit's parameters.
    out_bytes: its output activation (= the gradient sent back).
    kept_bytes: activation memory kept for the backward pass.
    family: the model's family, whose efficiency of a GPU type applies (vgg, resnet or default).
    selective / full: the backward pass and kept bytes under selective and full recomputation, as measured
      (None: not measured; :meth:`under` then estimates them, see there).
    transient_bytes: activation memory that the backward pass of one minibatch recomputes and holds while it
      runs (0 without recomputation; set by :meth:`under`).
    recompute: the recomputation these costs are under ("none" as profiled; set by :meth:`under`).
  """

  name: str
  fwd_flops: float
  bwd_flops: float
  fwd_bytes: float
  bwd_bytes: float
  param_bytes: int
  out_bytes: int
  kept_bytes: int
  family: str = "default"
  selective: Recomputed | None = None
  full: Recomputed | None = None
  transient_bytes: int = 0
  recompute: str = "none"

  def under(self, mode: str) -> UnitProfile:
    """This unit's profile under recomputation ``mode``: the backward pass with the recomputation, the bytes it
    keeps, and what the recomputation holds transiently (the bytes ``none`` would have kept beyond them).

    A profile without measured recomputation costs (a hand-made one) is estimated: ``full`` adds the forward
    pass to the backward and keeps nothing (a hand-made profile does not know its input's bytes); ``selective``
    is charged as ``none`` (an estimate that errs towards memory it does not save). A profile is taken under one
    mode once: under its own mode it is itself.

    Raises:
      ConfigError: for a mode that is not none, selective or full, or a profile under another mode already.
    """
    if check_recompute(mode, MODES) == self.recompute:
      return self
    if self.recompute != "none" or mode == "none":
      raise ConfigError(f"unit {self.name}'s profile is under recompute={self.recompute} already; take the "
                        f"profiled one (recompute=none) under {mode}")
    measured = self.selective if mode == "selective" else self.full
    if measured is None:
      measured = (Recomputed(self.bwd_flops, self.bwd_bytes, self.kept_bytes) if mode == "selective" else
                  Recomputed(self.bwd_flops + self.fwd_flops, self.bwd_bytes + self.fwd_bytes, 0))
    return dataclasses.replace(self, bwd_flops=measured.bwd_flops, bwd_bytes=measured.bwd_bytes,
                               kept_bytes=measured.kept_bytes,
                               transient_bytes=max(self.kept_bytes - measured.kept_bytes, 0), recompute=mode)


def under_modes(profiles: Sequence[UnitProfile], modes: Sequence[str]) -> list[UnitProfile]:
  """Every unit's profile under its own recomputation mode (:meth:`UnitProfile.under`; one mode per unit).

  Raises:
    ConfigError: for an unknown mode, or another number of modes than units.
  """
  if len(modes) != len(profiles):
    raise ConfigError(f"{len(modes)} recomputation modes for {len(profiles)} units; give one per unit")
  return [u.under(m) for u, m in zip(profiles, modes)]
