"""Per-unit cost profile of a model at the training batch size (docs/PROTOCOL.md section 4), cached on disk.

Per unit: forward and backward flops and bytes accessed from XLA's cost analysis of the *lowered* unit
(no compilation, no run, so full-size VGG-19 and ResNet-152 at 224x224 profile on a CPU), parameter
bytes, the bytes of its output activation (sent to the next stage; its gradient comes back), and the
activation memory it keeps for the backward pass (the ``jax.vjp`` residuals that are not parameters); the
backward pass and the kept memory again under selective recomputation (:mod:`hetpipe_jax.recompute`: the
backward's cost analysis then holds the recomputed part of the forward), and under full recomputation the
backward plus one more forward, keeping the unit's input (the textbook charge: XLA's analysis of the lowered
recomputing backward finds 10% fewer flops for a GPT block, ``tests/test_recompute.py``, and lowering it too
would double the cost of a profile again), and the activation bytes an eager framework keeps
(:data:`hetpipe_jax.recompute.EAGER`: the memory model's ``activations="eager"`` charge).
Units with the same definition and input shape (e.g. ResNet's repeated blocks, a GPT's transformer
blocks) are analysed once, so the cost is one lowering per distinct unit (a 13B GPT: three lowerings,
under a second; its parameters are never allocated, only their shapes); whole profiles are cached on
disk, keyed on the units, the input shape and the JAX version, in ``$HETPIPE_JAX_CACHE`` (default
``~/.cache/hetpipe_jax/profiles``).

A profile is a list of :class:`~hetpipe_jax.cost.unit.UnitProfile` (defined in its own module, importable
from here too). What it feeds: the roofline time (:mod:`~hetpipe_jax.cost.roofline`), stage memory
(:mod:`~hetpipe_jax.cost.memory`) and boundary transfers (:mod:`~hetpipe_jax.cost.transfer`). Every byte
count is of the fp32 model; a run in fp16/bf16 scales them where they are used
(:mod:`hetpipe_jax.precision`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from hetpipe_jax.cluster.catalogue import model_family
from hetpipe_jax.cost.memory import nbytes
from hetpipe_jax.cost.unit import Recomputed, TensorSplit, UnitProfile  # what a profile lists: importable here too
from hetpipe_jax.models import full_size_input, full_size_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.recompute import EAGER, checkpointed
from hetpipe_jax.tensor import split_param_bytes, unit_costs

CACHE_ENV = "HETPIPE_JAX_CACHE"  # the environment variable that names the profile cache directory
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hetpipe_jax", "profiles")  # its default
FROM_ENV = "$" + CACHE_ENV  # profile_units' default cache_dir: default_cache_dir() when called
PROFILE_FORMAT = 6  # bump when what a profile measures changes: old cache entries are then ignored


def _cost(fn, *args) -> tuple[float, float]:
  cost = jax.jit(fn).lower(*args).cost_analysis() or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _residual_bytes(g, p, x) -> tuple[Any, int]:
  """The ``jax.vjp`` closure of ``g`` at ``(p, x)`` as shapes, and its bytes that are not parameters."""
  residuals = jax.eval_shape(lambda p_, x_: jax.vjp(g, p_, x_)[1], p, x)
  return residuals, max(nbytes(residuals) - nbytes(p), 0)


def _backward(f, p, x, y, mode: str) -> Recomputed:
  """The backward pass of ``f`` under recomputation ``mode``: its cost (with the recomputed forward in it) and
  the activation bytes its ``jax.vjp`` closure keeps (its residuals that are not parameters)."""
  residuals, kept = _residual_bytes(checkpointed(f, mode), p, x)
  flops, moved = _cost(lambda vjp, ct: vjp(ct), residuals, y)  # the backward pass alone
  return Recomputed(flops, moved, kept)


def _profile_unit(name: str, unit, x) -> tuple[UnitProfile, Any]:
  f = lambda p, x_: unit.apply({"params": p}, x_)
  p = jax.eval_shape(lambda: unit.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype))["params"])
  y = jax.eval_shape(f, p, x)
  fwd_flops, fwd_bytes = _cost(f, p, x)
  bwd, selective = _backward(f, p, x, y, "none"), _backward(f, p, x, y, "selective")
  full = Recomputed(bwd.bwd_flops + fwd_flops, bwd.bwd_bytes + fwd_bytes, nbytes(x))  # one more forward
  eager = _residual_bytes(jax.checkpoint(f, policy=EAGER), p, x)[1]
  return UnitProfile(name, fwd_flops, bwd.bwd_flops, fwd_bytes, bwd.bwd_bytes, nbytes(p), nbytes(y),
                     bwd.kept_bytes, selective=selective, full=full, tp=_tensor_split(unit, p, x),
                     eager_kept_bytes=min(eager, bwd.kept_bytes)), y


def _tensor_split(unit, p, x) -> TensorSplit | None:
  """What the unit's tensor-parallel rule splits (:mod:`hetpipe_jax.tensor`), None without one."""
  costs = unit_costs(unit)
  if costs is None:
    return None
  return TensorSplit(split_param_bytes(unit, p), nbytes(x), costs.fwd_allreduces, costs.bwd_allreduces,
                     int(costs.whole_kept_inputs * nbytes(x)))


def _from_json(doc: dict[str, Any], family: str) -> UnitProfile:
  recomputed = {k: Recomputed(*doc[k]) for k in ("selective", "full") if doc.get(k) is not None}
  split = {"tp": TensorSplit(*doc["tp"])} if doc.get("tp") is not None else {}
  return UnitProfile(**{**doc, **recomputed, **split, "family": family})


def default_cache_dir() -> str:
  """The profile cache directory: ``$HETPIPE_JAX_CACHE`` if set, else ``~/.cache/hetpipe_jax/profiles``.

  Read at every call, so a process (a test session) can point it elsewhere after importing the package.

  Returns:
    The directory's path.
  """
  return os.path.expanduser(os.environ.get(CACHE_ENV) or CACHE_DIR)


def profile_units(model: LayeredModel, sample_x, cache_dir: str | None = FROM_ENV) -> list[UnitProfile]:
  """Profiles every unit of ``model`` on an input shaped like ``sample_x`` (leading axis = batch).

  Args:
    model: the model.
    sample_x: an array or a ``jax.ShapeDtypeStruct`` of one minibatch.
    cache_dir: where profiles are cached (keyed on the units, the input shape and the JAX version); by
      default :func:`default_cache_dir`; None turns the cache off.

  Returns:
    One profile per unit, in order.
  """
  if cache_dir == FROM_ENV:
    cache_dir = default_cache_dir()
  x = jax.ShapeDtypeStruct(sample_x.shape, sample_x.dtype)
  key = hashlib.sha1(repr((PROFILE_FORMAT, model.name, model.units, model.unit_names, x.shape,
                           str(x.dtype), jax.__version__)).encode()).hexdigest()[:20]
  path = os.path.join(cache_dir, f"{model.name}-{key}.json") if cache_dir else None
  family = model_family(model.name)
  if path and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return [_from_json(u, family) for u in json.load(f)]
  seen: dict[str, tuple[UnitProfile, Any]] = {}
  out = []
  for name, unit in zip(model.unit_names, model.units):
    sig = repr((unit, x.shape, str(x.dtype)))
    if sig not in seen:
      seen[sig] = _profile_unit(name, unit, x)
    prof, x = seen[sig]
    out.append(dataclasses.replace(prof, name=name, family=family))
  if path:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump([dataclasses.asdict(u) for u in out], f)
    os.replace(tmp, path)
  return out


def full_size_profiles(name: str, batch_size: int, cache_dir: str | None = FROM_ENV,
                       seq_len: int | None = None) -> list[UnitProfile]:
  """Profiles of a full-size model (:data:`hetpipe_jax.models.FULL_SIZE`) on its input shape.

  Args:
    name: a name of :data:`hetpipe_jax.models.FULL_SIZE`: ``"vgg16"``, ``"vgg19"``, ``"resnet50"``,
      ``"resnet101"``, ``"resnet152"``, ``"inception_v3"`` (299x299), ``"gpt2-xl"``, ``"gpt-6.7b"``, ``"gpt-13b"``.
    batch_size: examples per minibatch.
    cache_dir: see :func:`profile_units`.
    seq_len: a GPT's tokens per example (default: its context); None for the image models.

  Returns:
    One profile per unit.

  Raises:
    ConfigError: for a name that is not a full-size model, or a bad ``seq_len``.
  """
  return profile_units(full_size_model(name), full_size_input(name, batch_size, seq_len), cache_dir)

