"""The local optimizers by name, and how much state each keeps per parameter (its memory cost).

One registry serves the runtime (which builds the optax transformation), the planner and the memory
model (which charge ``slots`` parameter-sized copies of optimizer state per stage), and the experiment
scripts (which list the names)::

  tx = make_optimizer("momentum", 0.05)      # optax.sgd(0.05, momentum=0.9)
  optimizer_slots("adam")                    # 2: first and second moments
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optax

from hetpipe_jax.errors import ConfigError


class Optimizer(NamedTuple):
  """A named optax optimizer: its factory (learning rate -> transformation) and its state size."""

  make: Callable[[float], optax.GradientTransformation]
  slots: int  # parameter-sized arrays of state per parameter


OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer(optax.sgd, 0),
    "momentum": Optimizer(lambda lr: optax.sgd(lr, momentum=0.9), 1),
    "adam": Optimizer(optax.adam, 2),
}


def _get(name: str) -> Optimizer:
  if name not in OPTIMIZERS:
    raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
  return OPTIMIZERS[name]


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
  """The optax transformation of optimizer ``name`` at ``learning_rate``.

  Raises:
    ConfigError: for an unknown name.
  """
  return _get(name).make(learning_rate)


def optimizer_slots(name: str) -> int:
  """Parameter-sized copies of state that optimizer ``name`` keeps (sgd 0, momentum 1, adam 2).

  Raises:
    ConfigError: for an unknown name.
  """
  return _get(name).slots
