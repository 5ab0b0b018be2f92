"""Mixed-precision numerics of a stage: 16-bit compute, fp32 master weights, dynamic loss scaling for fp16.

Mixed precision as in Micikevicius et al., "Mixed Precision Training" (ICLR 2018), the way
:mod:`hetpipe_jax.precision` and the cost model charge it: a stage keeps fp32 weights (the master copy)
and fp32 optimizer state; its forward casts the weights and its input to 16 bits and computes in them
(the loss itself in fp32); the activations it sends, the input gradients it sends back and the weight
copies its forwards keep for their backwards are 16-bit; the weight gradient is cast back to fp32 for the
optimizer, and a wave's summed update is pushed in 16 bits (the PS adds it to its fp32 weights).

fp16's 5 exponent bits underflow small gradients, so fp16 scales the loss (dynamic loss scaling, as
NVIDIA Apex's ``GradScaler``): each stage holds a scale ``S`` (initially 2^16); it runs its backward with
the incoming gradient brought to its own scale (times ``S / S_in``, a power of two: exact) and divides
the weight gradient by ``S`` in fp32. A gradient with NaN or Inf is an overflow: the stage skips that
minibatch's update (weights and optimizer state unchanged, a zero update counted in its wave), halves
``S``, and the skip is recorded (the push line of the wave, docs/PROTOCOL.md); after ``GROWTH_INTERVAL``
clean steps in a row it doubles ``S``. The gradient it sends back carries its scale. Scaling per stage,
not one scale per pipeline, keeps every decision local: the stage that overflows backs off, and no stage
waits for another's verdict. bf16 has fp32's exponent range and needs no scaling.

Example::

  dtype = compute_dtype("bf16")          # jnp.bfloat16 (None for fp32: the fp32 programs are unchanged)
  w16 = cast_floats(params, dtype)       # floating leaves only
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hetpipe_jax.precision import check_precision

DTYPES = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}
INITIAL_SCALE = 2.0 ** 16  # Apex GradScaler's defaults
GROWTH_INTERVAL = 2000
SCALED = ("fp16",)  # the precisions that scale the loss


def compute_dtype(precision: str) -> Any:
  """The dtype a stage computes in at ``precision``; None for fp32 (no casts at all).

  Raises:
    ConfigError: for an unknown precision.
  """
  return DTYPES[check_precision(precision)]


def cast_floats(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating-point leaves cast to ``dtype`` (integer leaves, e.g. tokens, as they are)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def all_finite(tree: Any) -> jax.Array:
  """Whether every number in ``tree`` is finite (a scalar bool array; True for a tree without
  floating-point arrays): fp16's overflow check, the PS's check of a pushed update, the peers'.

  One sum per array: x - x is 0 for a finite x and NaN for NaN or Inf, so the sum is NaN exactly when
  one is not finite (3x faster on CPU than reducing ``isfinite``, whose boolean reduction is slow)."""
  sums = [jnp.sum(x - x) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return ~jnp.isnan(jnp.sum(jnp.stack(sums))) if sums else jnp.bool_(True)


class LossScale(NamedTuple):
  """A stage's dynamic loss scale: the scale (fp32 scalar) and the clean steps since it last changed."""

  scale: jax.Array
  good: jax.Array


def init_scale() -> LossScale:
  return LossScale(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.asarray(0, jnp.int32))


def next_scale(state: LossScale, finite: jax.Array) -> LossScale:
  """After a step: halved on an overflow (never below 1), doubled after ``GROWTH_INTERVAL`` clean steps."""
  good = jnp.where(finite, state.good + 1, 0)
  grow = good >= GROWTH_INTERVAL
  scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale), jnp.maximum(state.scale / 2, 1.0))
  return LossScale(scale, jnp.where(grow, 0, good).astype(jnp.int32))
