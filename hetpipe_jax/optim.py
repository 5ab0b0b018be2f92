"""The local optimizers by name, and how much state each keeps per parameter (its memory cost).

One registry serves the runtime (which builds the optax transformation), the planner and the memory
model (which charge ``slots`` parameter-sized copies of optimizer state per stage), and the experiment
scripts (which list the names)::

  tx = make_optimizer("momentum", 0.05)      # optax.sgd(0.05, momentum=0.9)
  optimizer_slots("adam")                    # 2: first and second moments

The parameter server's outer optimizer (``--ps_optimizer``, applied to every pushed wave's summed update)
is built here from its spec too::

  make_ps_optimizer("add")                             # None: the server's default, W <- W + delta
  make_ps_optimizer("nesterov:lr=0.7,momentum=0.9")    # DiLoCo's outer Nesterov step on -delta
"""

from __future__ import annotations

import functools
import math
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


# --- the parameter server's outer optimizer (--ps_optimizer) --------------------------------------------------

# name -> its keys and their defaults. The push is a wave's summed weight change delta; the outer gradient
# is -delta (DiLoCo, arXiv 2311.08105), so SGD with learning rate lr on it adds lr x delta.
PS_OPTIMIZERS: dict[str, dict[str, float]] = {
    "add": {},                                 # W <- W + delta: the paper's rule (the default)
    "sgd": {"lr": 1.0},                        # W <- W + lr x delta
    "momentum": {"lr": 0.7, "momentum": 0.9},  # heavy ball on -delta
    "nesterov": {"lr": 0.7, "momentum": 0.9},  # Nesterov momentum on -delta: DiLoCo's outer step
}
PS_OPTIMIZER_EXAMPLE = "nesterov:lr=0.7,momentum=0.9"


class PSOptimizer(NamedTuple):
  """A parsed ``--ps_optimizer`` spec: its name and its keys (``momentum`` is 0 where the name has none)."""

  name: str
  lr: float = 1.0
  momentum: float = 0.0

  def __str__(self) -> str:
    """The canonical spec (what the trace's meta line records): ``add``, ``sgd:lr=0.5``, ..."""
    keys = PS_OPTIMIZERS[self.name]
    return self.name + (":" + ",".join(f"{k}={getattr(self, k)!r}" for k in keys) if keys else "")

  @property
  def slots(self) -> int:
    """Parameter-sized arrays of state the parameter server keeps for it (the momentum's trace: 0 or 1)."""
    return 1 if "momentum" in PS_OPTIMIZERS[self.name] else 0


def parse_ps_optimizer(spec: str) -> PSOptimizer:
  """Parses ``NAME[:KEY=VALUE,...]``: ``add``, ``sgd:lr=0.5``, ``momentum:lr=0.7,momentum=0.9``,
  ``nesterov:lr=0.7,momentum=0.9`` (keys left out take :data:`PS_OPTIMIZERS`' defaults).

  Raises:
    ConfigError: (one line) for an unknown name or key, a value that is not a number, lr <= 0 or not
      finite, momentum outside [0, 1).
  """
  if not isinstance(spec, str):
    raise ConfigError(f"ps_optimizer={spec!r}; give a string such as add or {PS_OPTIMIZER_EXAMPLE}")
  name, _, rest = spec.strip().partition(":")
  name = name.strip()
  if name not in PS_OPTIMIZERS:
    raise ConfigError(f"ps_optimizer={spec!r}: unknown optimizer {name!r}; choose one of {', '.join(PS_OPTIMIZERS)} "
                      f"(e.g. {PS_OPTIMIZER_EXAMPLE})")
  keys, values = PS_OPTIMIZERS[name], {}
  for item in filter(None, (part.strip() for part in rest.split(","))):
    key, eq, text = (s.strip() for s in item.partition("="))
    if key not in keys:
      known = f"its keys are {', '.join(keys)}" if keys else "it takes no keys"
      raise ConfigError(f"ps_optimizer={spec!r}: {name} has no key {key!r}; {known}")
    if key in values:
      raise ConfigError(f"ps_optimizer={spec!r}: {key} is given twice; give each key once")
    try:
      values[key] = float(text) if eq else float("")
    except ValueError:
      raise ConfigError(f"ps_optimizer={spec!r}: {item!r} is not KEY=NUMBER; write e.g. "
                        f"{PS_OPTIMIZER_EXAMPLE}") from None
  parsed = PSOptimizer(name, **{**keys, **values})
  if "lr" in keys and not (math.isfinite(parsed.lr) and parsed.lr > 0):
    raise ConfigError(f"ps_optimizer={spec!r}: lr={parsed.lr}; the outer learning rate must be a finite number "
                      "> 0 (1 with momentum 0 is the plain add; DiLoCo uses 0.7)")
  if "momentum" in keys and not 0 <= parsed.momentum < 1:
    raise ConfigError(f"ps_optimizer={spec!r}: momentum={parsed.momentum}; the outer momentum must be in [0, 1) "
                      "(DiLoCo uses 0.9)")
  return parsed


@functools.cache
def _ps_transformation(spec: PSOptimizer) -> optax.GradientTransformation | None:
  if spec.name == "add":
    return None
  scale = optax.scale(spec.lr)
  if spec.name == "sgd":
    return scale
  return optax.chain(optax.trace(decay=spec.momentum, nesterov=spec.name == "nesterov"), scale)


def make_ps_optimizer(spec: str | PSOptimizer) -> optax.GradientTransformation | None:
  """The parameter server's apply rule of a ``--ps_optimizer`` spec (:func:`parse_ps_optimizer`); None for
  ``add`` (the server's default, ``optax.identity()``: bit-identical to the runs before the flag).

  The transformation takes the pushed wave's summed update delta (its outer gradient is -delta) and returns
  what the server adds to the weights: ``sgd`` lr x delta; ``momentum`` lr x m_t with m_t = delta + momentum x
  m_{t-1}; ``nesterov`` lr x (delta + momentum x m_t), i.e. ``optax.chain(optax.trace(momentum, nesterov=True),
  optax.scale(lr))`` (= ``optax.sgd(lr, momentum, nesterov=True)`` on -delta, DiLoCo's outer step). One spec
  gives one object (cached), so configs with the same spec compare equal.

  Raises:
    ConfigError: for a bad spec (see :func:`parse_ps_optimizer`).
  """
  return _ps_transformation(spec if isinstance(spec, PSOptimizer) else parse_ps_optimizer(spec))
