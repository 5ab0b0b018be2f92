"""Per-unit cost profile, the roofline time model, stage memory, and the cost model of a cluster.

Per unit of a model at the training batch size (HETPIPE.md section 4): forward and backward flops and
bytes accessed from XLA's cost analysis of the *lowered* unit (no compilation, no run, so full-size VGG-19
and ResNet-152 at 224x224 profile on a CPU), parameter bytes, the bytes of its output activation (sent to
the next stage; its gradient comes back), and the activation memory it keeps for the backward pass (the
``jax.vjp`` residuals that are not parameters). Units with the same definition and input shape (e.g.
ResNet's repeated blocks) are analysed once; whole profiles are cached on disk, in ``$HETPIPE_JAX_CACHE``
(default ``~/.cache/hetpipe_jax/profiles``).

Time of a unit on a GPU type (roofline)::

  t = max(flops / peak_flops, bytes / memory_bandwidth) / efficiency

with a per-type efficiency that :func:`calibrate_efficiency` fits to measured times.

Memory of a stage = parameters x (weights + gradient + optimizer slots + Nm - 1 stashed copies in
``stash`` mode) + Nm x kept activations.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from hetpipe_jax.cluster.topology import Cluster, Gpu, GpuType
from hetpipe_jax.models.base import LayeredModel

CACHE_ENV = "HETPIPE_JAX_CACHE"  # the environment variable that names the profile cache directory
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hetpipe_jax", "profiles")  # its default
FROM_ENV = "$" + CACHE_ENV  # profile_units' default cache_dir: default_cache_dir() when called
PROFILE_FORMAT = 2  # bump when what a profile measures changes: old cache entries are then ignored


@dataclasses.dataclass(frozen=True)
class UnitProfile:
  """Cost of one unit at one batch size."""

  name: str
  fwd_flops: float
  bwd_flops: float
  fwd_bytes: float  # bytes accessed
  bwd_bytes: float
  param_bytes: int
  out_bytes: int  # output activation (= its gradient)
  kept_bytes: int  # activation memory kept for the backward pass

  def seconds(self, gpu: GpuType, precision: str = "fp32") -> tuple[float, float]:
    """(forward, backward) seconds on ``gpu`` by the roofline model."""
    peak = gpu.peak_flops(precision)
    roof = lambda flops, nbytes: max(flops / peak, nbytes / gpu.mem_bytes_per_s) / gpu.efficiency
    return roof(self.fwd_flops, self.fwd_bytes), roof(self.bwd_flops, self.bwd_bytes)


def nbytes(tree) -> int:
  """Bytes of every array (or shape struct) in ``tree``."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _spec(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _cost(fn, *args) -> tuple[float, float]:
  cost = jax.jit(fn).lower(*args).cost_analysis() or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _profile_unit(name: str, unit, x) -> tuple[UnitProfile, Any]:
  f = lambda p, x_: unit.apply({"params": p}, x_)
  p = jax.eval_shape(lambda: unit.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype))["params"])
  y = jax.eval_shape(f, p, x)
  fwd_flops, fwd_bytes = _cost(f, p, x)
  residuals = jax.eval_shape(lambda p_, x_: jax.vjp(f, p_, x_)[1], p, x)  # the vjp closure, as shapes
  bwd_flops, bwd_bytes = _cost(lambda vjp, g: vjp(g), residuals, y)  # the backward pass alone
  params = nbytes(p)
  return UnitProfile(name, fwd_flops, bwd_flops, fwd_bytes, bwd_bytes, params, nbytes(y),
                     max(nbytes(residuals) - params, 0)), y


def default_cache_dir() -> str:
  """The profile cache directory: ``$HETPIPE_JAX_CACHE`` if set, else ``~/.cache/hetpipe_jax/profiles``.

  Read at every call, so a process (a test session) can point it elsewhere after importing the package.
  """
  return os.path.expanduser(os.environ.get(CACHE_ENV) or CACHE_DIR)


def profile_units(model: LayeredModel, sample_x, cache_dir: str | None = FROM_ENV) -> list[UnitProfile]:
  """Profiles every unit of ``model`` on an input shaped like ``sample_x`` (leading axis = batch).

  ``sample_x`` may be an array or a ``jax.ShapeDtypeStruct``. With ``cache_dir``, a profile computed once
  is read back from ``cache_dir`` (keyed on the units, the input shape and the JAX version); by default
  that is :func:`default_cache_dir`, None turns the cache off.
  """
  if cache_dir == FROM_ENV:
    cache_dir = default_cache_dir()
  x = jax.ShapeDtypeStruct(sample_x.shape, sample_x.dtype)
  key = hashlib.sha1(repr((PROFILE_FORMAT, model.name, model.units, model.unit_names, x.shape,
                           str(x.dtype), jax.__version__)).encode()).hexdigest()[:20]
  path = os.path.join(cache_dir, f"{model.name}-{key}.json") if cache_dir else None
  if path and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return [UnitProfile(**u) for u in json.load(f)]
  seen: dict[str, tuple[UnitProfile, Any]] = {}
  out = []
  for name, unit in zip(model.unit_names, model.units):
    sig = repr((unit, x.shape, str(x.dtype)))
    if sig not in seen:
      seen[sig] = _profile_unit(name, unit, x)
    prof, x = seen[sig]
    out.append(dataclasses.replace(prof, name=name))
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump([dataclasses.asdict(u) for u in out], f)
    os.replace(tmp, path)
  return out


def calibrate_efficiency(gpu: GpuType, profiles: Sequence[UnitProfile], measured: dict[int, float],
                         precision: str = "fp32") -> GpuType:
  """Returns ``gpu`` with the efficiency that makes the roofline match measured times.

  Args:
    gpu: the GPU type the times were measured on.
    profiles: the model's unit profiles.
    measured: unit index -> measured forward + backward seconds on ``gpu``.
  """
  ideal = dataclasses.replace(gpu, efficiency=1.0)
  model = sum(sum(profiles[u].seconds(ideal, precision)) for u in measured)
  return dataclasses.replace(gpu, efficiency=model / sum(measured.values()))


def stage_memory_bytes(units: Sequence[UnitProfile], nm: int, weight_mode: str,
                       optimizer_slots: float) -> int:
  """Memory of one stage: parameters x (weights + gradient + optimizer slots + Nm - 1 stashed copies in
  stash mode) + Nm x the activations kept for the backward pass."""
  params = sum(u.param_bytes for u in units)
  copies = 2 + optimizer_slots + (nm - 1 if weight_mode == "stash" else 0)
  return int(params * copies + nm * sum(u.kept_bytes for u in units))


def stage_transfers(profiles: Sequence[UnitProfile], cut: Sequence[int], gpus: Sequence[Gpu],
                    j: int) -> tuple[tuple[int, Gpu] | None, tuple[int, Gpu] | None]:
  """(bytes, source GPU) that stage j receives: its input activation before a forward pass (from stage
  j-1) and its output gradient before a backward pass (from stage j+1); None where nothing crosses (the
  first and last stage, and cuts at the very start or end of the model, where only empty stages sit)."""
  n = len(profiles)
  fwd = (profiles[cut[j] - 1].out_bytes, gpus[j - 1]) if j > 0 and 0 < cut[j] < n else None
  bwd = ((profiles[cut[j + 1] - 1].out_bytes, gpus[j + 1])
         if j < len(gpus) - 1 and 0 < cut[j + 1] < n else None)
  return fwd, bwd


def stage_compute_seconds(profiles: Sequence[UnitProfile], cut: Sequence[int], gpu: Gpu, j: int,
                          precision: str = "fp32") -> tuple[float, float]:
  """(forward, backward) seconds of stage j's units on its GPU, by the roofline."""
  times = [u.seconds(gpu.type, precision) for u in profiles[cut[j]:cut[j + 1]]]
  return sum(t[0] for t in times), sum(t[1] for t in times)


def stage_seconds(cluster: Cluster, profiles: Sequence[UnitProfile], cut: Sequence[int],
                  gpus: Sequence[Gpu], j: int, precision: str = "fp32") -> tuple[float, float]:
  """(forward, backward) seconds of stage j: its units on its GPU, plus receiving its input activation
  (forward) and its output gradient (backward) over the links from its neighbours, alone on the link."""
  fwd, bwd = stage_compute_seconds(profiles, cut, gpus[j], j, precision)
  recv_fwd, recv_bwd = stage_transfers(profiles, cut, gpus, j)
  if recv_fwd:
    fwd += cluster.transfer_seconds(recv_fwd[1], gpus[j], recv_fwd[0])
  if recv_bwd:
    bwd += cluster.transfer_seconds(recv_bwd[1], gpus[j], recv_bwd[0])
  return fwd, bwd
