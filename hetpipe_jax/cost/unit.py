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


class TensorSplit(NamedTuple):
  """What a unit with a tensor-parallel rule (:mod:`hetpipe_jax.tensor`) splits across a stage's devices.

  Attributes:
    split_param_bytes: its parameters that are split (the rest stays whole on every device).
    in_bytes: its input activation (what each all-reduce sums: a GPT block's output is its input's shape).
    fwd_allreduces / bwd_allreduces: all-reduces of ``in_bytes`` per forward / backward pass.
    whole_kept_bytes: activations kept whole on every device (the LayerNorms' inputs, say), of ``kept_bytes``.
  """

  split_param_bytes: int
  in_bytes: int
  fwd_allreduces: int
  bwd_allreduces: int
  whole_kept_bytes: int


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
    tp: what tensor parallelism splits (None: the unit has no rule and runs whole on each of a stage's devices).
    degree: the devices these costs are per device of (1 as profiled; set by :meth:`split`).
    eager_kept_bytes: of ``kept_bytes``, what an eager framework (PyTorch, TensorFlow without XLA) keeps
      (:data:`hetpipe_jax.recompute.EAGER`); None: not measured, charged as ``kept_bytes``.
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
  tp: TensorSplit | None = None
  degree: int = 1
  eager_kept_bytes: int | None = None

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
                               transient_bytes=max(self.kept_bytes - measured.kept_bytes, 0), recompute=mode,
                               eager_kept_bytes=None)  # (what the recomputation keeps, in any framework)

  def split(self, degree: int) -> UnitProfile:
    """This unit's costs per device of a stage split over ``degree`` devices (:mod:`hetpipe_jax.tensor`).

    A unit with a rule divides its flops, bytes moved, split parameters and kept activations (but the whole
    ones) by the degree, as Megatron-LM's split of a transformer layer does (Korthikanti et al., arXiv 2205.05198,
    section 4.2; the whole LayerNorms' flops are charged split too, a few percent of a block's), and its costs
    under each recomputation alike, so :meth:`under` may come before or after; a unit without a rule runs whole
    on every device. The all-reduces are charged by the cost model (:meth:`allreduce_bytes`).

    Raises:
      ConfigError: for a degree below 1, or a profile split already.
    """
    if degree < 1 or self.degree != 1:
      raise ConfigError(f"unit {self.name}'s profile split over {degree} devices (split over {self.degree} "
                        "already); split a profile of one device over a degree >= 1")
    if degree == 1 or self.tp is None:
      return dataclasses.replace(self, degree=degree)
    t, whole = degree, self.tp.whole_kept_bytes
    kept = lambda b: min(b, whole) + (b - min(b, whole)) // t  # what stays whole, and a t-th of the rest
    split = lambda r: None if r is None else Recomputed(r.bwd_flops / t, r.bwd_bytes / t, kept(r.kept_bytes))
    params = self.param_bytes - self.tp.split_param_bytes + self.tp.split_param_bytes // t
    return dataclasses.replace(
        self, fwd_flops=self.fwd_flops / t, bwd_flops=self.bwd_flops / t, fwd_bytes=self.fwd_bytes / t,
        bwd_bytes=self.bwd_bytes / t, param_bytes=params, kept_bytes=kept(self.kept_bytes),
        eager_kept_bytes=None if self.eager_kept_bytes is None else kept(self.eager_kept_bytes),
        selective=split(self.selective), full=split(self.full),
        transient_bytes=kept(self.kept_bytes + self.transient_bytes) - kept(self.kept_bytes), degree=t)

  def allreduce_bytes(self, kind: str) -> tuple[int, int]:
    """(all-reduces, bytes each) of one ``kind`` ("fwd" or "bwd") pass across the devices it is split over
    ((0, 0) on one device or without a rule)."""
    if self.degree == 1 or self.tp is None:
      return 0, 0
    return (self.tp.fwd_allreduces if kind == "fwd" else self.tp.bwd_allreduces), self.tp.in_bytes


def under_modes(profiles: Sequence[UnitProfile], modes: Sequence[str]) -> list[UnitProfile]:
  """Every unit's profile under its own recomputation mode (:meth:`UnitProfile.under`; one mode per unit).

  Raises:
    ConfigError: for an unknown mode, or another number of modes than units.
  """
  if len(modes) != len(profiles):
    raise ConfigError(f"{len(modes)} recomputation modes for {len(profiles)} units; give one per unit")
  return [u.under(m) for u, m in zip(profiles, modes)]
