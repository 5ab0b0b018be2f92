"""A Flax NNX module as a unit: its parameters an ordinary pytree, its forward a pure function of them.

An NNX module holds its state in itself (``nnx.Linear(4, 8, rngs=nnx.Rngs(0))`` is already initialised).
:class:`NnxUnit` splits it once (``nnx.split``) into a graph definition and its ``nnx.Param`` variables,
and offers what every unit offers (:mod:`hetpipe_jax.models.base`)::

  unit.init(rng, x)               -> {"params": the module's own initial parameters}  (rng unused)
  unit.apply({"params": p}, x)    -> nnx.merge(graphdef, p)(x)

The parameters are a flat dict ``{"path/to/param": array}`` (string keys, so the parameter server, the
optimizers and checkpoints see a plain pytree). Any state besides parameters (batch statistics, dropout's
RNG streams, other variables) is refused: a stage must be a pure function of its parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from hetpipe_jax.errors import ConfigError


def _key(path: tuple[Any, ...]) -> str:
  return "/".join(map(str, path))


class NnxUnit:
  """An NNX module seen as a unit (see the module docstring).

  Args:
    module: the NNX module (its current parameters are the unit's initial ones).
    name: the unit's name (for errors).

  Raises:
    ConfigError: when the module holds state besides ``nnx.Param`` variables, or no parameters.
  """

  def __init__(self, module: nnx.Module, name: str):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    others = sorted({f"{type(v).__name__} at {_key(path)}" for path, v in nnx.to_flat_state(rest)})
    if others:
      raise ConfigError(f"unit {name!r} ({type(module).__name__}) holds state besides parameters: "
                        f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''}; only nnx.Param state is "
                        "supported (no batch statistics, no dropout RNGs): use LayerNorm/GroupNorm, drop dropout")
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(params))
    if not flat:
      raise ConfigError(f"unit {name!r} ({type(module).__name__}) has no parameters; every unit needs some: "
                        "join it to a neighbour (one module applying both)")
    self._graphdef = graphdef
    self._paths = {_key(path): path for path in flat}
    self._params = {_key(path): jnp.asarray(value) for path, value in flat.items()}
    try:  # equal graphs (the same layers, the same functions) profile once
      graph = hash(graphdef)
    except TypeError:  # an unhashable attribute: this unit's own profile
      graph = id(self)
    self._label = (f"NnxUnit({type(module).__name__}, "
                   f"{sorted((k, v.shape, str(v.dtype)) for k, v in self._params.items())}, {graph})")

  def __repr__(self) -> str:  # the profiler keys its cache and its reuse of equal units on this
    return self._label

  def init(self, rng: jax.Array, x: jax.Array) -> dict[str, Any]:
    """The module's own initial parameters, as ``{"params": ...}`` (``rng`` and ``x`` are not used)."""
    del rng, x
    return {"params": dict(self._params)}

  def apply(self, variables: dict[str, Any], x: jax.Array) -> Any:
    """The module's forward with the parameters ``variables["params"]``."""
    state = nnx.from_flat_state({self._paths[k]: v for k, v in variables["params"].items()})
    return nnx.merge(self._graphdef, state)(x)
