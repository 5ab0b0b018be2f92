"""Per-unit cost profile and the cost model that turns it into task durations and memory on a cluster.

Per unit of a model at the training batch size (HETPIPE.md section 4): forward and backward flops from
XLA's cost analysis of the lowered unit (no compilation, no run), parameter bytes, and the bytes of its
output activation (sent to the next stage, and its gradient sent back).

Task time on an emulated GPU = the stage's flops / the GPU's flop/s + moving the stage's input (forward)
or output gradient (backward) over the link from its neighbour. Memory of a stage = parameters x (weights
+ gradient + optimizer slots + Nm - 1 stashed copies in ``stash`` mode) + Nm x its kept activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from hetpipe_jax.cluster import GIB, Cluster, Gpu
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel


@dataclasses.dataclass(frozen=True)
class UnitProfile:
  """Cost of one unit at one batch size."""

  name: str
  fwd_flops: float
  bwd_flops: float
  param_bytes: int
  out_bytes: int


def nbytes(tree) -> int:
  """Bytes of every array (or shape struct) in ``tree``."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _flops(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).cost_analysis().get("flops", 0.0))


def profile_units(model: LayeredModel, params: Sequence[Any], sample_x) -> list[UnitProfile]:
  """Profiles every unit of ``model`` on an input shaped like ``sample_x`` (its leading axis = batch)."""
  spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
  x = spec(sample_x)
  out = []
  for name, unit, p in zip(model.unit_names, model.units, params):
    f = lambda p_, x_, unit=unit: unit.apply({"params": p_}, x_)
    y = jax.eval_shape(f, spec(p), x)
    fwd = _flops(f, spec(p), x)
    both = _flops(lambda p_, x_, g, f=f: jax.vjp(f, p_, x_)[1](g), spec(p), x, y)
    out.append(UnitProfile(name, fwd, max(both - fwd, fwd), nbytes(p), nbytes(y)))
    x = y
  return out


def stage_memory_bytes(units: Sequence[UnitProfile], nm: int, weight_mode: str,
                       optimizer_slots: float) -> int:
  """Memory of one stage: parameters x (weights + gradient + optimizer slots + stashed copies) + Nm x
  kept activations (each unit's output, kept for the backward pass)."""
  params = sum(u.param_bytes for u in units)
  copies = 2 + optimizer_slots + (nm - 1 if weight_mode == "stash" else 0)
  return int(params * copies + nm * sum(u.out_bytes for u in units))


class CostModel:
  """Task durations of every (virtual worker, stage) on an emulated cluster.

  Args:
    cluster: the emulated cluster (links).
    profiles: per-unit profile of the model.
    cuts: per virtual worker, the unit boundaries of its stages (``[0, c1, ..., num_units]``).
    gpus: per virtual worker, the GPU of each stage.
  """

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], cuts: Sequence[Sequence[int]],
               gpus: Sequence[Sequence[Gpu]]):
    self._seconds: dict[tuple[int, int, str], float] = {}
    for i, (cut, group) in enumerate(zip(cuts, gpus)):
      k = len(group)
      for j in range(k):
        units, gpu = profiles[cut[j]:cut[j + 1]], group[j]
        fwd = sum(u.fwd_flops for u in units) / gpu.type.flops
        bwd = sum(u.bwd_flops for u in units) / gpu.type.flops
        if j > 0:  # receive the activation from stage j-1
          fwd += cluster.transfer_seconds(group[j - 1], gpu, profiles[cut[j] - 1].out_bytes)
        if j < k - 1:  # receive the gradient from stage j+1
          bwd += cluster.transfer_seconds(group[j + 1], gpu, profiles[cut[j + 1] - 1].out_bytes)
        self._seconds[(i, j, "fwd")] = fwd
        self._seconds[(i, j, "bwd")] = bwd

  def task_seconds(self, vw: int, stage: int, kind: str) -> float:
    return self._seconds[(vw, stage, kind)]


def check_memory(profiles: Sequence[UnitProfile], cuts: Sequence[Sequence[int]],
                 gpus: Sequence[Sequence[Gpu]], nms: Sequence[int], weight_mode: str,
                 optimizer_slots: float) -> None:
  """Raises ConfigError naming the first stage that does not fit its GPU's memory."""
  for i, (cut, group, nm) in enumerate(zip(cuts, gpus, nms)):
    for j, gpu in enumerate(group):
      need = stage_memory_bytes(profiles[cut[j]:cut[j + 1]], nm, weight_mode, optimizer_slots)
      if need > gpu.type.memory_bytes:
        raise ConfigError(
            f"stage {j} of virtual worker {i} (units {cut[j]}..{cut[j + 1] - 1}) needs "
            f"{need / GIB:.2f} GiB with Nm={nm} ({weight_mode}), but GPU {gpu.name} has "
            f"{gpu.type.memory_bytes / GIB:.2f} GiB; use more stages, a smaller Nm or batch size, "
            "weight_mode=latest, or a cluster with more memory")
