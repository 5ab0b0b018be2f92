"""Bring your own model: Flax modules (linen or NNX) as a :class:`~hetpipe_jax.models.LayeredModel`.

A model the planner can cut is a sequence of units, each a module whose output is the next one's input.
:func:`from_modules` takes that sequence; :func:`from_module` takes one ``Sequential`` (``flax.linen`` or
``flax.nnx``) and groups its layers into units at named cut points. Either way the model carries its
loss (default: :func:`~hetpipe_jax.models.base.cross_entropy` on integer labels) and one example's input
shape, so it is profiled, planned and simulated without data, and trained like the built-in models::

  import flax.linen as nn
  from flax import nnx
  from hetpipe_jax import from_modules

  model = from_modules([nn.Dense(64), lambda rngs: nnx.Linear(64, 10, rngs=rngs)], input_shape=(64,),
                       names=["hidden", "logits"])

Every unit is checked on the input shape when the model is built (a unit that cannot take the output of
the one before, keeps mutable state such as batch statistics, or has no parameters is one
:class:`~hetpipe_jax.errors.ConfigError`). A linen unit is initialised from the run's seed, and so is an NNX unit
given as a function of ``rngs`` (``lambda rngs: nnx.Linear(64, 10, rngs=rngs)``); an NNX module given built
keeps the parameters it holds, and a run with a seed other than 0 refuses it (:mod:`hetpipe_jax.models.nnx_unit`).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import InputSpec, LayeredModel, Loss, cross_entropy
from hetpipe_jax.models.nnx_unit import NnxUnit, build_module

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")  # unit and model names appear in plans, traces and file names


def _input_spec(input_shape: Sequence[int], input_dtype: str) -> InputSpec:
  shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
  if not shape or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in shape):
    raise ConfigError(f"input_shape={input_shape!r}; give one example's shape (no batch axis) as positive "
                      "integers, e.g. input_shape=(28, 28, 1)")
  try:
    dtype = jnp.dtype(input_dtype)
  except TypeError:
    raise ConfigError(f"input_dtype={input_dtype!r} is not a dtype; use e.g. 'float32' or 'int32'") from None
  return InputSpec(tuple(int(n) for n in shape), dtype.name)


def _check_name(what: str, value: Any) -> str:
  if not isinstance(value, str) or not _NAME.match(value):
    raise ConfigError(f"{what}={value!r}; use a non-empty name of letters, digits, '_', '.' or '-'")
  return value


def _unit_names(modules: Sequence[Any], names: Sequence[str] | None) -> tuple[str, ...]:
  if names is None:
    return tuple(f"{type(m).__name__.lower()}{i}" for i, m in enumerate(modules))
  if isinstance(names, str) or len(names) != len(modules):
    raise ConfigError(f"names={names!r} must name each of the {len(modules)} units once, in order")
  names = tuple(_check_name("unit name", n) for n in names)
  if len(set(names)) != len(names):
    raise ConfigError(f"names={list(names)} repeat a name; give every unit its own")
  return names


def _as_unit(module: Any, index: int, name: str) -> Any:
  """A linen module (or a unit of another model) as it is, an NNX module or a function of rngs that builds one
  wrapped (:class:`NnxUnit`); anything else refused."""
  if isinstance(module, (nn.Module, NnxUnit)):
    return module
  if isinstance(module, nnx.Module) or callable(module):
    return NnxUnit(module, name)
  raise ConfigError(f"unit {index} ({name!r}) is a {type(module).__name__}, not a Flax module; give "
                    "flax.linen or flax.nnx modules (a function such as relu goes inside a module)")


def _first_line(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def _check_params(name: str, variables: Any) -> None:
  """A unit's variables hold parameters and nothing else (no batch statistics)."""
  mutable = sorted(set(variables) - {"params"})
  if mutable:
    raise ConfigError(f"unit {name!r} keeps mutable state ({', '.join(mutable)}); only parameters are "
                      "supported (no batch statistics): use LayerNorm/GroupNorm instead of BatchNorm")
  if not jax.tree.leaves(variables.get("params", {})):
    raise ConfigError(f"unit {name!r} has no parameters; every unit needs some: join it to a neighbour "
                      "(from_module with a cut elsewhere, or one module applying both)")


def _check_units(units: Sequence[Any], names: Sequence[str], spec: InputSpec) -> None:
  """Initialises every unit on the output shape of the one before (shapes only, batch 2).

  Raises:
    ConfigError: for a unit that cannot take its input, keeps state besides parameters, or has none.
  """
  x: Any = jax.ShapeDtypeStruct((2, *spec.shape), jnp.dtype(spec.dtype))
  where = f"input {spec.shape} {spec.dtype}"
  for unit, name in zip(units, names):
    shape = tuple(x.shape[1:])
    try:
      variables = jax.eval_shape(unit.init, jax.random.key(0), x)
      _check_params(name, variables)
      y = jax.eval_shape(lambda p, x_, unit=unit: unit.apply({"params": p}, x_), variables["params"], x)
    except ConfigError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # a module fails in many ways on a wrong input
      raise ConfigError(f"unit {name!r} cannot take the {where} (one example: {shape}): {_first_line(e)}; "
                        "check the order of the units and input_shape") from None
    if not isinstance(y, jax.ShapeDtypeStruct):
      raise ConfigError(f"unit {name!r} returns {type(y).__name__}, not one array; a unit's output is the "
                        "next unit's input")
    x, where = y, f"output of unit {name!r}"


def from_modules(modules: Sequence[Any], *, input_shape: Sequence[int], input_dtype: str = "float32",
                 names: Sequence[str] | None = None, loss: Loss = cross_entropy,
                 name: str = "custom") -> LayeredModel:
  """A cuttable model from Flax modules, one unit each, applied in order.

  Example::

    model = from_modules([nn.Dense(64), lambda rngs: nnx.Linear(64, 10, rngs=rngs)], input_shape=(64,))
    run_hetpipe(model, synthetic(), RunConfig.of(num_vws=2, stages=2, waves=4))

  Args:
    modules: ``flax.linen`` modules (initialised from the run's seed), functions of ``rngs`` that build a
      ``flax.nnx`` module (likewise), or ``flax.nnx`` modules (their own parameters are the initial ones,
      whatever the seed), each taking the previous one's output, the first the input (the units of another
      such model too, e.g. to give it another loss).
    input_shape: one example's input shape, without the batch axis (e.g. ``(28, 28, 1)``).
    input_dtype: the input's dtype (``"int32"`` for tokens).
    names: one name per unit (for plans and traces; default: the class name and the index).
    loss: ``(outputs of the last unit, labels) -> the mean loss over the minibatch's labels``, a scalar;
      default: softmax cross-entropy with integer labels. The test accuracy compares the argmax of the
      outputs with the labels.
    name: the model's name (in traces, summaries and the profile cache's file names).

  Returns:
    The model.

  Raises:
    ConfigError: for an empty list, something that is not a Flax module, bad names, a bad input shape or
      dtype, a loss that is not callable, or a unit that cannot take its input, keeps mutable state or has
      no parameters.
  """
  if isinstance(modules, (nn.Module, nnx.Module)) or not isinstance(modules, Sequence) or not modules:
    raise ConfigError(f"modules={type(modules).__name__}; give a non-empty list of Flax modules (one module "
                      "with cut points: from_module)")
  _check_name("name", name)
  if not callable(loss):
    raise ConfigError(f"loss={loss!r} is not callable; give a function (outputs, labels) -> scalar mean loss")
  spec = _input_spec(input_shape, input_dtype)
  unit_names = _unit_names(modules, names)
  units = tuple(_as_unit(m, i, n) for i, (m, n) in enumerate(zip(modules, unit_names)))
  _check_units(units, unit_names, spec)
  return LayeredModel(name, units, unit_names, loss, spec)


def check_data(model: LayeredModel, param_shapes: Any, x: Any, labels: Any, num_classes: int,
               data_name: str) -> None:
  """A brought model (one with an input spec or its own loss) against a dataset, before a run: the input's
  shape and dtype, an output per class for cross-entropy, and a float scalar loss on the labels.

  Args:
    model: the model (a built-in one, without input spec and with cross-entropy, passes unchecked).
    param_shapes: its parameters' shapes on ``x``.
    x / labels: one minibatch of the data (or their shapes).
    num_classes / data_name: the dataset's class count and name (for the errors).

  Raises:
    ConfigError: naming what does not fit and what to change.
  """
  spec = model.input_spec
  if spec is None and model.loss is cross_entropy:
    return  # a built-in model: its tests check it
  got = (tuple(x.shape[1:]), jnp.dtype(x.dtype).name)
  if spec is not None and got != (spec.shape, spec.dtype):
    raise ConfigError(f"model {model.name!r} takes {spec.shape} {spec.dtype} examples but {data_name} has "
                      f"{got[0]} {got[1]}; build the model with input_shape={got[0]}, input_dtype={got[1]!r}")
  out = jax.eval_shape(model.apply, param_shapes, x)
  labels = jax.ShapeDtypeStruct(labels.shape, labels.dtype)
  if model.loss is cross_entropy and out.shape[-1] < num_classes:
    raise ConfigError(f"model {model.name!r} outputs {out.shape[-1]} scores per example but {data_name} has "
                      f"{num_classes} classes; give its last unit {num_classes} outputs")
  try:
    loss = jax.eval_shape(model.loss, out, labels)
  except Exception as e:  # pylint: disable=broad-except  # a user's loss fails in many ways
    raise ConfigError(f"the loss of model {model.name!r} fails on outputs {out.shape} and {data_name}'s labels "
                      f"{labels.shape} ({_first_line(e)}); fix the loss or the last unit") from None
  if getattr(loss, "shape", None) != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise ConfigError(f"the loss of model {model.name!r} returns {getattr(loss, 'shape', loss)} "
                      f"{getattr(loss, 'dtype', '')}; it must return the mean loss, a float scalar (e.g. .mean())")


def _layer_name(layer: Any, index: int) -> str:
  explicit = getattr(layer, "name", None) if isinstance(layer, nn.Module) else None
  return explicit or f"{getattr(layer, '__name__', type(layer).__name__).lower()}{index}"


def _starts(layer_names: Sequence[str], cut_points: Sequence[str | int]) -> list[int]:
  """The layer index where each unit starts: 0, then each cut point (a layer's name or index)."""
  if isinstance(cut_points, str):
    cut_points = [cut_points]
  out = [0]
  for c in cut_points:
    if isinstance(c, str) and c in layer_names:
      i = layer_names.index(c)
    elif isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c < len(layer_names):
      i = int(c)
    else:
      raise ConfigError(f"cut point {c!r} is not a layer; use a layer's name or index: "
                        f"{', '.join(f'{i}={n}' for i, n in enumerate(layer_names))}")
    if i <= out[-1]:
      raise ConfigError(f"cut points {list(cut_points)} must name layers after the first, in increasing "
                        "order, each once")
    out.append(i)
  return out


def _group(layers: Sequence[Any], kind: Any) -> Any:
  """Layers as one unit: a module alone as it is, else a ``kind`` Sequential of them."""
  return layers[0] if len(layers) == 1 and isinstance(layers[0], (nn.Module, nnx.Module)) else kind(*layers)


def _built_group(build: Any, first: int, last: int, *, rngs: nnx.Rngs) -> Any:
  """Layers ``first .. last-1`` of the ``nnx.Sequential`` that ``build(rngs=rngs)`` returns, as one unit."""
  return _group(build(rngs=rngs).layers[first:last], nnx.Sequential)


def from_module(module: Any, cut_points: Sequence[str | int] | None = None, *, input_shape: Sequence[int],
                input_dtype: str = "float32", loss: Loss = cross_entropy, name: str = "custom",
                names: Sequence[str] | None = None) -> LayeredModel:
  """A cuttable model from one ``Sequential`` module, its layers grouped into units at ``cut_points``.

  Example::

    net = nnx.Sequential(nnx.Linear(64, 128, rngs=rngs), nnx.relu, nnx.Linear(128, 10, rngs=rngs))
    model = from_module(net, cut_points=["linear2"], input_shape=(64,))  # units: linear0+relu1, linear2

  Args:
    module: a ``flax.linen.Sequential`` or a ``flax.nnx.Sequential``, or a function of ``rngs`` that builds the
      latter (each unit is then initialised from the run's seed, :func:`from_modules`).
    cut_points: the layers where a new unit starts, by name or index (layer names: a linen module's own
      ``name``, else the class or function name in lower case and the index, e.g. ``linear2``, ``relu1``);
      None: every layer is a unit. Each unit needs parameters, so a function such as ``relu`` rides with
      the layer before it.
    input_shape / input_dtype / loss / name: as :func:`from_modules`.
    names: one name per unit (default: the name of its first layer).

  Returns:
    The model.

  Raises:
    ConfigError: for a module that is not a ``Sequential``, a cut point that is not one of its layers or
      out of order, or anything :func:`from_modules` refuses.
  """
  build = None
  if callable(module) and not isinstance(module, (nn.Module, nnx.Module)):
    build, module = module, build_module(module, nnx.Rngs(0), name)
  if not isinstance(module, (nn.Sequential, nnx.Sequential)):
    raise ConfigError(f"module is a {type(module).__name__}; from_module cuts a flax.linen.Sequential or a "
                      "flax.nnx.Sequential (or give the units as a list: from_modules)")
  layers = list(module.layers)
  layer_names = [_layer_name(layer, i) for i, layer in enumerate(layers)]
  starts = _starts(layer_names, range(1, len(layers)) if cut_points is None else cut_points)
  bounds = list(zip(starts, starts[1:] + [len(layers)]))
  kind = nnx.Sequential if isinstance(module, nnx.Sequential) else (lambda *ls: nn.Sequential(list(ls)))
  units = ([_group(layers[a:b], kind) for a, b in bounds] if build is None
           else [functools.partial(_built_group, build, a, b) for a, b in bounds])
  names = [layer_names[a] for a in starts] if names is None else names
  return from_modules(units, input_shape=input_shape, input_dtype=input_dtype, names=names, loss=loss, name=name)


def load_factory(spec: str) -> LayeredModel:
  """The model that ``package.module:factory`` builds (the factory is called with no arguments).

  How a process that builds its model from a command line (``--model``, each process of a multi-process
  run) gets a user's model: the module must be importable there (on ``PYTHONPATH``, or under the working
  directory).

  Raises:
    ConfigError: for a spec that is not ``package.module:factory``, a module that cannot be imported, a
      missing or failing factory, or one that does not return a LayeredModel.
  """
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".") + attr.split(".")):
    raise ConfigError(f"model {spec!r} is not package.module:factory; write e.g. "
                      "--model=examples.residual_mlp:model, or a built-in model's name")
  try:
    target: Any = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  # the user's module may fail in any way
    raise ConfigError(f"model {spec!r}: module {module_name!r} cannot be imported ({_first_line(e)}); put it on "
                      "PYTHONPATH or under the working directory") from None
  for part in attr.split("."):
    if not hasattr(target, part):
      raise ConfigError(f"model {spec!r}: {module_name} has no {attr!r}; name a function there that returns the "
                        "model")
    target = getattr(target, part)
  if not callable(target):
    raise ConfigError(f"model {spec!r}: {attr} is a {type(target).__name__}, not a function; name a function "
                      "that takes no arguments and returns the model")
  try:
    model = target()
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"model {spec!r}: {attr}() failed ({_first_line(e)}); it must build the model with no "
                      "arguments") from None
  if not isinstance(model, LayeredModel):
    raise ConfigError(f"model {spec!r}: {attr}() returned a {type(model).__name__}; return the LayeredModel of "
                      "hetpipe_jax.from_modules or from_module")
  return model
