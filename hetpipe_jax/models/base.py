"""Models as ordered sequences of units that can be cut at any boundary into contiguous stages.

A unit is a Flax module applied as ``y = unit.apply({"params": p}, x)`` (a Flax NNX module is adapted to
that, :mod:`hetpipe_jax.models.nnx_unit`); a model is a tuple of units and the parameters are a tuple with
one entry per unit. A stage ``[first, last)`` applies units first..last-1. No unit keeps mutable state (no
batch statistics), so every stage is a pure function of its parameters. The model carries its loss (the
last stage applies it to the last unit's output and the labels) and, optionally, the shape of one example
(so it can be profiled, planned and simulated without a dataset). Models a user brings are built by
:mod:`hetpipe_jax.models.custom`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.recompute import checkpointed

Params = tuple[Any, ...]  # one Flax parameter dict per unit
Unit = Any  # a Flax linen module, or anything with its init(rng, x) -> {"params": p} and apply({"params": p}, x)
Loss = Callable[[jax.Array, jax.Array], jax.Array]  # (last unit's outputs, labels) -> the mean loss, a scalar


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy with integer labels (per example, or per token of a sequence model).

  Args:
    logits: ``(batch, classes)``, or ``(batch, seq, classes)`` (a GPT's next-token logits).
    labels: ``(batch,)`` integer classes, or ``(batch, seq)`` (the next tokens).

  Returns:
    The mean loss over every label, a scalar.
  """
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class InputSpec(NamedTuple):
  """One example's input: its shape (no batch axis) and dtype."""

  shape: tuple[int, ...]
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class LayeredModel:
  """A model as a sequence of units.

  Attributes:
    name: model name.
    units: the units in order.
    unit_names: a readable name per unit (used in plans and traces).
    loss: ``(outputs of the last unit, labels) -> the mean loss over the minibatch's labels`` (a scalar),
      which the last stage differentiates and the evaluation reports as ``test_loss``.
    input_spec: one example's input (None: taken from the dataset it trains on).
  """

  name: str
  units: tuple[Unit, ...]
  unit_names: tuple[str, ...]
  loss: Loss = dataclasses.field(default=cross_entropy, repr=False)
  input_spec: InputSpec | None = None

  @property
  def num_units(self) -> int:
    """The number of units (cut positions are 0 .. num_units)."""
    return len(self.units)

  def sample_input(self, batch_size: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of a minibatch of ``batch_size`` examples (needs :attr:`input_spec`)."""
    if self.input_spec is None:
      raise ConfigError(f"model {self.name!r} has no input_spec; give one (from_modules(..., input_shape=...)) "
                        "or take the input's shape from a dataset")
    return jax.ShapeDtypeStruct((batch_size, *self.input_spec.shape), jnp.dtype(self.input_spec.dtype))

  def init(self, rng: jax.Array, sample_x: jax.Array) -> Params:
    """Initialises every unit in turn on the output shape of the one before (one jitted program).

    Args:
      rng: a PRNG key (split into one key per unit).
      sample_x: a minibatch (its shape and dtype matter).

    Returns:
      The parameters, one Flax parameter dict per unit.
    """
    return jax.jit(self._init)(rng, sample_x)

  def _init(self, rng, x):
    params = []
    for unit, key in zip(self.units, jax.random.split(rng, self.num_units)):
      p = unit.init(key, x)["params"]
      x = unit.apply({"params": p}, x)
      params.append(p)
    return tuple(params)

  def apply(self, params: Sequence[Any], x: jax.Array, first: int = 0, last: int | None = None,
            recompute: str = "none"):
    """Applies units ``first .. last-1`` (the whole model by default) to ``x``.

    Args:
      params: the parameters of units ``first .. last-1`` (one entry per unit, in order).
      x: the input of unit ``first``.
      first / last: the units to apply; ``last`` defaults to the number of units.
      recompute: each unit's activation recomputation in a backward pass through this apply
        (:mod:`hetpipe_jax.recompute`): "none", "selective" or "full".

    Returns:
      The output of unit ``last - 1``.
    """
    last = self.num_units if last is None else last
    y: Any = x
    for unit, p in zip(self.units[first:last], params):
      y = checkpointed(_unit_apply(unit), recompute)(p, y)
    return y


def _unit_apply(unit: Unit) -> Callable[[Any, Any], Any]:
  return lambda p, x: unit.apply({"params": p}, x)


def num_params(params) -> int:
  """The number of parameters (array elements) in a pytree of arrays or shape structs."""
  return sum(int(x.size) for x in jax.tree.leaves(params))


class DenseUnit(nn.Module):
  """Dense layer with an optional ReLU, flattening its input first."""

  features: int
  relu: bool = True

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(self.features)(x)
    return nn.relu(x) if self.relu else x


class ConvUnit(nn.Module):
  """3x3 convolution + ReLU, then an optional 2x2 max pool."""

  features: int
  pool: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(self.features, (3, 3))(x))
    if self.pool:
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    return x
