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
  make_ps_optimizer("avg", num_vws=4)                  # W <- W + delta / 4: each push scaled by 1/N
  make_ps_optimizer("delayed_nesterov", num_vws=4)     # one Nesterov step per 4 pushes (Async Local-SGD)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
# N is the number of virtual workers (``num_vws`` of :func:`make_ps_optimizer`).
PS_OPTIMIZERS: dict[str, dict[str, float]] = {
    "add": {},                                 # W <- W + delta: the paper's rule (the default)
    "sgd": {"lr": 1.0},                        # W <- W + lr x delta
    "momentum": {"lr": 0.7, "momentum": 0.9},  # heavy ball on -delta
    "nesterov": {"lr": 0.7, "momentum": 0.9},  # Nesterov momentum on -delta: DiLoCo's outer step
    "avg": {"lr": 1.0},                        # W <- W + lr x delta / N: the pushes averaged
    "delayed_nesterov": {"lr": 0.7, "momentum": 0.9},  # one Nesterov step per N pushes (Async Local-SGD)
}
PS_OPTIMIZER_EXAMPLE = "nesterov:lr=0.7,momentum=0.9"
BY_ROUND = ("avg", "delayed_nesterov")  # the rules whose step depends on N


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
    """Parameter-sized arrays of state the parameter server keeps for it (the momentum's trace; Delayed
    Nesterov's buffer of the round's pushes too)."""
    return 2 if self.name == "delayed_nesterov" else int("momentum" in PS_OPTIMIZERS[self.name])


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


class DelayedNesterovState(NamedTuple):
  """Delayed Nesterov's state: pushes so far, the momentum, and the buffer of the pushes since its last step."""

  count: Any
  momentum: Any
  buffer: Any


def delayed_nesterov(lr: float, momentum: float, every: int) -> optax.GradientTransformation:
  """Delayed Nesterov, the outer step of Async Local-SGD (Liu et al. 2024, "Asynchronous Local-SGD Training for
  Language Modeling", arXiv 2401.09135, Algorithm 2 with c = 0), on pushed updates delta (outer gradient -delta).

  Every push adds ``lr x delta / every`` at once; the pushes are also summed in a buffer, and every ``every``-th
  push (one round of ``every`` virtual workers) the momentum takes one step on the buffer's mean and its
  Nesterov term is added too::

    b <- b + delta
    push k % every != 0:  W <- W + lr x delta / every
    push k % every == 0:  m <- momentum x m + b / every;  W <- W + lr x (delta / every + momentum x m);  b <- 0

  So momentum moves once per round, never on each stale push, which is what breaks plain Nesterov under
  asynchrony; with ``every`` = 1 it is Nesterov momentum (``nesterov`` here) exactly.
  """

  def init(params):  # (two trees of zeros, not one twice: the server donates the state's buffers)
    return DelayedNesterovState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params),
                                jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    count = state.count + 1
    step = count % every == 0
    buffer = jax.tree.map(jnp.add, state.buffer, updates)
    m = jax.tree.map(lambda m, b: jnp.where(step, momentum * m + b / every, m), state.momentum, buffer)
    out = jax.tree.map(lambda u, m: lr * (u / every + jnp.where(step, momentum * m, jnp.zeros_like(m))), updates, m)
    buffer = jax.tree.map(lambda b: jnp.where(step, jnp.zeros_like(b), b), buffer)
    return out, DelayedNesterovState(count, m, buffer)

  return optax.GradientTransformation(init, update)


@functools.cache
def _ps_transformation(spec: PSOptimizer, num_vws: int) -> optax.GradientTransformation | None:
  if spec.name == "add":
    return None
  if spec.name == "avg":
    return optax.scale(spec.lr / num_vws)
  if spec.name == "delayed_nesterov":
    return delayed_nesterov(spec.lr, spec.momentum, num_vws)
  scale = optax.scale(spec.lr)
  if spec.name == "sgd":
    return scale
  return optax.chain(optax.trace(decay=spec.momentum, nesterov=spec.name == "nesterov"), scale)


def make_ps_optimizer(spec: str | PSOptimizer, num_vws: int = 1) -> optax.GradientTransformation | None:
  """The parameter server's apply rule of a ``--ps_optimizer`` spec (:func:`parse_ps_optimizer`) for ``num_vws``
  virtual workers; None for ``add`` (the server's default, ``optax.identity()``: bit-identical to the runs
  before the flag).

  The transformation takes the pushed wave's summed update delta (its outer gradient is -delta) and returns
  what the server adds to the weights: ``sgd`` lr x delta; ``momentum`` lr x m_t with m_t = delta + momentum x
  m_{t-1}; ``nesterov`` lr x (delta + momentum x m_t), i.e. ``optax.chain(optax.trace(momentum, nesterov=True),
  optax.scale(lr))`` (= ``optax.sgd(lr, momentum, nesterov=True)`` on -delta, DiLoCo's outer step); ``avg``
  lr x delta / N, each push scaled by 1/N as Async Local-SGD does (Liu et al. 2024), so N pushes move the
  weights as far as one synchronous round of averaged local SGD; ``delayed_nesterov`` :func:`delayed_nesterov`
  with a round of N pushes. One spec and N give one object (cached), so configs with the same spec compare equal.

  Raises:
    ConfigError: for a bad spec (see :func:`parse_ps_optimizer`) or ``num_vws`` < 1.
  """
  if num_vws < 1:
    raise ConfigError(f"num_vws={num_vws}; the parameter server's rule needs at least 1 virtual worker")
  parsed = spec if isinstance(spec, PSOptimizer) else parse_ps_optimizer(spec)
  return _ps_transformation(parsed, num_vws if parsed.name in BY_ROUND else 1)
