"""Memory of a pipeline stage (docs/PROTOCOL.md section 4): the one definition the planner and the checks use.

A stage of a virtual worker holding units with ``P`` parameter bytes and ``A`` bytes of activations kept
for the backward pass (both counted in fp32, as profiled), at Nm minibatches in flight, needs::

  memory = P x copies + (Nm x A + R) x s
  copies = 1 (weights) + 1 (wave accumulator) + optimizer slots + s x Nm (stashed weight versions, stash mode)

where ``A`` is each unit's :func:`kept` bytes (this runtime's, or with ``activations="eager"`` what PyTorch or
TensorFlow keep), ``R`` is what recomputation holds while one minibatch's backward pass runs (the largest of the stage's
units' recomputed activations, :meth:`hetpipe_jax.cost.unit.UnitProfile.under`; 0 without recomputation, where
``A`` is every activation the units keep, and with it ``A`` is what the recomputation policy keeps), and
with ``s`` = :func:`hetpipe_jax.precision.byte_scale` (1 in fp32, 1/2 in 16 bits): what a stage of the
runtime holds between tasks (:class:`hetpipe_jax.runtime.numerics.stage.Stage`, measured in
``tests/test_mixed_precision.py``). The weights and the optimizer slots are fp32 in every precision (in
mixed precision, Micikevicius et al., ICLR 2018, the weights are the fp32 master copy); so is the wave
accumulator, the sum of a wave's local updates that a pull adds back to the fp32 weights (HetPipe's local
updates; in fp32 training it takes the gradient's place in the usual count). Every minibatch in flight keeps
the weight version its forward used (PipeDream-style weight stashing: the residuals of its ``jax.vjp``
closure, in the compute precision), each a buffer of its own; ``latest`` keeps none. With Adam (2 slots)
and ``latest`` that is 4 + 4 + 8 = 16 bytes per parameter in every precision; stashing adds 4 (fp32) or 2
(fp16/bf16) bytes per version, and 16 bits halve the activations. The formula is linear in (P, A), so it
applies to a stage's totals and, unit by unit, to the prefix sums of the partitioner's DP alike
(:func:`memory_bytes` takes scalars or numpy arrays). Optimizer slots are parameter-sized (fp32) copies of
optimizer state: :func:`hetpipe_jax.optim.optimizer_slots` by name, or measured from an optax transformation
by :func:`optimizer_slots_of`. O(units) per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.precision import byte_scale, is_mixed

if TYPE_CHECKING:
  import optax

  from hetpipe_jax.cost.unit import UnitProfile


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


def param_copies(nm: int, costs: CostContext = DEFAULT_COSTS) -> float:
  """fp32-parameter-sized copies a stage holds: weights + wave accumulator + optimizer slots (all fp32) +
  the stashed weight versions (one per minibatch in flight, in the compute precision).

  Args:
    nm: most minibatches in flight (>= 1).
    costs: the weight mode (``"stash"``: Nm stashed weight versions; ``"latest"``: none), the
      parameter-sized fp32 arrays of optimizer state, the precision ("fp32", or "fp16"/"bf16": mixed
      precision, see the module docstring), and the staleness control (``2bw`` stashes ceil(Nm / k) + 1 versions
      and keeps a gradient sum, ``predict`` its last update: :mod:`hetpipe_jax.core.controls`).

  Returns:
    ``2 + optimizer_slots + control copies + s x stashed``, where stashed = ``nm`` in stash mode (the control's
    versions), else 0, and s =
    :func:`hetpipe_jax.precision.byte_scale` (1 in fp32, 1/2 in fp16/bf16).

  Raises:
    ConfigError: for an unknown precision.

  With ``costs.state_shards`` = N > 1 (data-parallel replicas under ZeRO stage 2: Rajbhandari et al., "ZeRO:
  memory optimizations toward training trillion parameter models", SC'20, section 5) each replica keeps the
  whole weights but 1/N of the gradient and of the optimizer slots: ``1 + (1 + optimizer_slots) / N + s x
  stashed``. Its gradients meet by a reduce-scatter and the updated weights by an all-gather, the bytes of one
  ring all-reduce (ibid., section 7), so the simulators' all-reduce times it unchanged. With
  ``costs.shard_weights`` too (ZeRO stage 3, FSDP) the weights are sharded as well: ``(2 + optimizer_slots) / N
  + s x stashed``, and :func:`stage_memory_bytes` adds the units it gathers.
  """
  stashed = costs.control.stashed_versions(nm) if costs.weight_mode == "stash" else 0
  shards = costs.state_shards
  held = (2 + costs.optimizer_slots if shards == 1
          else (2 + costs.optimizer_slots) / shards if costs.shard_weights
          else 1 + (1 + costs.optimizer_slots) / shards) + costs.control.extra_copies
  if not is_mixed(costs.precision):
    return held + stashed  # (integers stay integers)
  return held + stashed * byte_scale(costs.precision)


def memory_bytes(param_bytes, kept_bytes, nm: int, costs: CostContext = DEFAULT_COSTS, transient_bytes: float = 0):
  """The stage-memory formula on parameter and kept-activation bytes (scalars or numpy arrays).

  Args:
    param_bytes: parameter bytes in fp32 (of a stage, or of each unit as an array).
    kept_bytes: activation bytes in fp32 kept for the backward pass, per minibatch (same shape).
    nm / costs: see :func:`param_copies`.
    transient_bytes: activation bytes in fp32 that one minibatch's backward pass recomputes and holds while
      it runs (the largest of the stage's units under recomputation; 0 without).

  Returns:
    ``param_bytes x param_copies(...) + (nm x kept_bytes + transient_bytes) x byte_scale(precision)``,
    elementwise.

  Raises:
    ConfigError: for an unknown precision.
  """
  copies = param_copies(nm, costs)
  if not is_mixed(costs.precision):
    return param_bytes * copies + nm * kept_bytes + transient_bytes
  return param_bytes * copies + (nm * kept_bytes + transient_bytes) * byte_scale(costs.precision)


ACTIVATIONS = ("jax", "eager")  # CostContext.activations: what a unit without recomputation is charged


def check_activations(value: str) -> str:
  """Returns ``value`` if it names an activation charge.

  Raises:
    ConfigError: naming the value and the choices.
  """
  if value not in ACTIVATIONS:
    raise ConfigError(f"activations={value!r}; use jax (every residual of jax.vjp: this package's runtime) or "
                      "eager (what PyTorch or TensorFlow without XLA keep: the systems that run in them)")
  return value


def kept(unit: UnitProfile, costs: CostContext = DEFAULT_COSTS) -> int:
  """Activation bytes (fp32) that ``unit`` keeps per minibatch under ``costs.activations``: its ``kept_bytes``,
  or with ``"eager"`` and no recomputation, what an eager framework keeps where measured
  (:data:`hetpipe_jax.recompute.EAGER`; about 0.47 of the runtime's for ResNet-152, 0.38 for a GPT-2 XL block).

  Raises:
    ConfigError: for an unknown charge.
  """
  if check_activations(costs.activations) == "eager" and unit.eager_kept_bytes is not None:
    return unit.eager_kept_bytes
  return unit.kept_bytes


def stage_memory_bytes(units: Sequence[UnitProfile], nm: int, costs: CostContext = DEFAULT_COSTS) -> int:
  """Memory of one stage holding ``units`` (see the module docstring).

  Args:
    units: the profiles of the stage's units.
    nm / costs: see :func:`param_copies`.

  Returns:
    Bytes, rounded down. With the weights sharded (``costs.shard_weights`` over ``state_shards`` > 1, as FSDP
    runs: each unit's weights gathered for its forward and freed after it, gathered again for its backward) the
    largest unit is charged three more times in the compute precision, as :data:`GATHERED` says.

  Raises:
    ConfigError: for an unknown precision.
  """
  transient = max((u.transient_bytes for u in units), default=0)
  if costs.shard_weights and costs.state_shards > 1:
    transient += GATHERED * max((u.param_bytes for u in units), default=0)
  return int(memory_bytes(sum(u.param_bytes for u in units), sum(kept(u, costs) for u in units), nm, costs,
                          transient))


GATHERED = 3  # whole units FSDP holds at once: the one computing, the next prefetched, an unreduced gradient
