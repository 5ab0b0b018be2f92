"""A Flax NNX module as a unit: its parameters an ordinary pytree, its forward a pure function of them.

An NNX module holds its state in itself (``nnx.Linear(4, 8, rngs=nnx.Rngs(0))`` is already initialised), so
the run's seed reaches it only through a function that builds it from ``rngs``
(``lambda rngs: nnx.Linear(4, 8, rngs=rngs)``, called as ``build(rngs=...)``). :class:`NnxUnit` takes either,
splits the module once (``nnx.split``) into a graph definition and its ``nnx.Param`` variables, and offers what
every unit offers (:mod:`hetpipe_jax.models.base`)::

  unit.init(rng, x)               -> {"params": the module built from rng}, or a built module's own parameters
  unit.apply({"params": p}, x)    -> nnx.merge(graphdef, p)(x)

A module given built keeps the parameters it holds whatever the seed (:attr:`NnxUnit.seeded` is False: a run
with another seed than 0 refuses it, :func:`hetpipe_jax.run.setup.prepare`).

The parameters are a flat dict ``{"path/to/param": array}`` (string keys, so the parameter server, the
optimizers and checkpoints see a plain pytree). Any state besides parameters (batch statistics, dropout's
RNG streams, other variables) is refused: a stage must be a pure function of its parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from hetpipe_jax.errors import ConfigError


def _key(path: tuple[Any, ...]) -> str:
  return "/".join(map(str, path))


Build = Callable[..., Any]  # rngs=nnx.Rngs(...) -> an NNX module (checked by build_module)


def _split(module: nnx.Module, name: str) -> tuple[Any, dict[tuple[Any, ...], Any]]:
  """(the module's graph definition, its parameters by path).

  Raises:
    ConfigError: when the module holds state besides ``nnx.Param`` variables, or no parameters.
  """
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
  return graphdef, flat


def build_module(build: Build, rngs: nnx.Rngs, name: str) -> nnx.Module:
  """The module ``build(rngs=rngs)`` returns.

  Raises:
    ConfigError: when ``build`` fails or returns something else than an NNX module.
  """
  try:
    module = build(rngs=rngs)
  except Exception as e:  # pylint: disable=broad-except  # not a function of rngs, or a failing one
    raise ConfigError(f"unit {name!r} is a {type(build).__name__}, not a Flax module nor a function of rngs that "
                      f"builds an NNX module ({type(e).__name__} when called as f(rngs=...)); give flax.linen or "
                      "flax.nnx modules, or e.g. lambda rngs: nnx.Linear(64, 10, rngs=rngs) (a function such as relu "
                      "goes inside a module)") from None
  if not isinstance(module, nnx.Module):
    raise ConfigError(f"unit {name!r}: its function of rngs returned a {type(module).__name__}, not an NNX module")
  return module


class NnxUnit:
  """An NNX module seen as a unit (see the module docstring).

  Args:
    module: the NNX module (its current parameters are the unit's initial ones, whatever the seed), or a
      function that builds it from ``rngs`` (the unit is then initialised from the run's seed).
    name: the unit's name (for errors).

  Raises:
    ConfigError: when the module holds state besides ``nnx.Param`` variables, or no parameters, or the
      function does not build an NNX module.
  """

  def __init__(self, module: nnx.Module | Build, name: str):
    self._make = None if isinstance(module, nnx.Module) else module
    if self._make is not None:
      module = build_module(self._make, nnx.Rngs(0), name)
    assert isinstance(module, nnx.Module)
    graphdef, flat = _split(module, name)
    self._name = name
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

  @property
  def seeded(self) -> bool:
    """Whether :meth:`init` draws the parameters from its key (a unit given as a function of rngs)."""
    return self._make is not None

  def init(self, rng: jax.Array, x: jax.Array) -> dict[str, Any]:
    """``{"params": ...}`` of the module built from ``rng`` (a built module's own parameters: ``rng`` unused);
    ``x`` is not used."""
    del x
    if self._make is None:
      return {"params": dict(self._params)}
    flat = _split(build_module(self._make, nnx.Rngs(rng), self._name), self._name)[1]
    return {"params": {_key(path): value for path, value in flat.items()}}

  def apply(self, variables: dict[str, Any], x: jax.Array) -> Any:
    """The module's forward with the parameters ``variables["params"]``."""
    state = nnx.from_flat_state({self._paths[k]: v for k, v in variables["params"].items()})
    return nnx.merge(self._graphdef, state)(x)
