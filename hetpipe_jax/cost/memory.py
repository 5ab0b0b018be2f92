"""Memory of a pipeline stage (HETPIPE.md section 4): the one definition the planner and the checks use.

A stage of a virtual worker holding units with ``P`` parameter bytes and ``A`` bytes of activations kept
for the backward pass, at Nm minibatches in flight, needs::

  memory = P x copies + Nm x A
  copies = 1 (weights) + 1 (gradient) + optimizer slots + (Nm - 1 stashed weight versions in stash mode)

(PipeDream-style weight stashing keeps up to Nm - 1 extra versions of the stage's weights; ``latest``
keeps none). The formula is linear in (P, A), so it applies to a stage's totals and, unit by unit, to
the prefix sums of the partitioner's DP alike (:func:`memory_bytes` takes scalars or numpy arrays).
Optimizer slots are parameter-sized copies of optimizer state: :func:`hetpipe_jax.optim.optimizer_slots`
by name, or measured from an optax transformation by :func:`optimizer_slots_of`. O(units) per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  import optax

  from hetpipe_jax.cost.profile import UnitProfile


def nbytes(tree: Any) -> int:
  """Bytes of every array (or shape struct) in a pytree.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct``.

  Returns:
    The sum of size x item size over its leaves.
  """
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def optimizer_slots_of(tx: optax.GradientTransformation, params: Any) -> float:
  """Parameter-sized copies of state that ``tx`` keeps for ``params``: state bytes / parameter bytes.

  Args:
    tx: an optax transformation.
    params: a pytree of parameters (arrays or shape structs); nothing is computed.

  Returns:
    The ratio (e.g. 0 for plain SGD, 1 for momentum, a little over 2 for Adam with its step count).
  """
  shapes = jax.eval_shape(lambda p: p, params)
  return nbytes(jax.eval_shape(tx.init, shapes)) / max(nbytes(shapes), 1)


def param_copies(nm: int, weight_mode: str, optimizer_slots: float) -> float:
  """Parameter-sized copies a stage holds: weights + gradient + optimizer slots + stashed versions.

  Args:
    nm: most minibatches in flight (>= 1).
    weight_mode: ``"stash"`` (Nm - 1 stashed weight versions) or ``"latest"`` (none).
    optimizer_slots: parameter-sized arrays of optimizer state.

  Returns:
    ``2 + optimizer_slots + (nm - 1 if weight_mode == "stash" else 0)``.
  """
  return 2 + optimizer_slots + (nm - 1 if weight_mode == "stash" else 0)


def memory_bytes(param_bytes, kept_bytes, nm: int, weight_mode: str, optimizer_slots: float):
  """The stage-memory formula on parameter and kept-activation bytes (scalars or numpy arrays).

  Args:
    param_bytes: parameter bytes (of a stage, or of each unit as an array).
    kept_bytes: activation bytes kept for the backward pass, per minibatch (same shape).
    nm / weight_mode / optimizer_slots: see :func:`param_copies`.

  Returns:
    ``param_bytes x param_copies(...) + nm x kept_bytes``, elementwise.
  """
  return param_bytes * param_copies(nm, weight_mode, optimizer_slots) + nm * kept_bytes


def stage_memory_bytes(units: Sequence[UnitProfile], nm: int, weight_mode: str,
                       optimizer_slots: float) -> int:
  """Memory of one stage holding ``units`` (see the module docstring).

  Args:
    units: the profiles of the stage's units.
    nm / weight_mode / optimizer_slots: see :func:`param_copies`.

  Returns:
    Bytes, rounded down.
  """
  return int(memory_bytes(sum(u.param_bytes for u in units), sum(u.kept_bytes for u in units), nm,
                          weight_mode, optimizer_slots))
