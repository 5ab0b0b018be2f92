"""The roofline time of units on a GPU type, and its calibration (docs/PROTOCOL.md section 4).

A unit's forward (or backward) pass with ``flops`` floating-point operations touching ``bytes`` of memory
takes, on a GPU type::

  t = max(flops / peak_flops, bytes / memory_bandwidth) / efficiency

where ``efficiency`` is the type's correction factor for the model's family, fitted to measured
throughput (the catalogue cites each figure) or to measured times by
:func:`calibrate_efficiency`. A stage's compute is the sum over its units. O(1) per unit.

Precision (:mod:`hetpipe_jax.precision`): ``peak_flops`` is the type's peak at that precision (fp16, and
bf16 where the type has bf16 tensor cores, use the tensor-core peak), and the profiles' fp32 ``bytes``
are scaled by :func:`~hetpipe_jax.precision.byte_scale` (a 16-bit pass moves half the bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hetpipe_jax.cluster import Gpu, GpuType
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.precision import byte_scale


def roofline_seconds(flops: float, num_bytes: float, gpu: GpuType, precision: str = "fp32",
                     family: str = "default") -> float:
  """Seconds of one pass with ``flops`` operations over ``num_bytes`` on ``gpu`` (the formula above).

  Args:
    flops: floating-point operations.
    num_bytes: bytes of memory accessed.
    gpu: the GPU type.
    precision: "fp32", "fp16" or "bf16": which peak applies, and ``num_bytes`` (counted in fp32) x
      :func:`~hetpipe_jax.precision.byte_scale`.
    family: the model family, whose efficiency applies (:func:`hetpipe_jax.cluster.catalogue.model_family`).

  Returns:
    Seconds.

  Raises:
    ConfigError: for an unknown precision.
  """
  num_bytes = num_bytes * byte_scale(precision)
  return max(flops / gpu.peak_flops(precision), num_bytes / gpu.mem_bytes_per_s) / gpu.efficiency_for(family)


def unit_seconds(unit: UnitProfile, gpu: GpuType, precision: str = "fp32") -> tuple[float, float]:
  """A unit's time on a GPU type by the roofline (:func:`roofline_seconds`, the unit's family's efficiency).

  Args:
    unit: the unit's profile.
    gpu: the GPU type.
    precision: "fp32", "fp16" or "bf16".

  Returns:
    (forward, backward) seconds.
  """
  return (roofline_seconds(unit.fwd_flops, unit.fwd_bytes, gpu, precision, unit.family),
          roofline_seconds(unit.bwd_flops, unit.bwd_bytes, gpu, precision, unit.family))


def stage_compute_seconds(profiles: Sequence[UnitProfile], cut: Sequence[int], gpu: Gpu, j: int,
                          precision: str = "fp32") -> tuple[float, float]:
  """Compute time of stage j's units ``cut[j] .. cut[j + 1] - 1`` on its GPU, by the roofline.

  Args:
    profiles: per-unit profiles of the model.
    cut: the virtual worker's cut positions.
    gpu: the stage's GPU.
    j: the stage.
    precision: "fp32", "fp16" or "bf16".

  Returns:
    (forward, backward) seconds.
  """
  times = [unit_seconds(u, gpu.type, precision) for u in profiles[cut[j]:cut[j + 1]]]
  return sum(t[0] for t in times), sum(t[1] for t in times)


def model_compute_seconds(profiles: Sequence[UnitProfile], gpu: GpuType, precision: str = "fp32") -> float:
  """Forward + backward of every unit of the model on one GPU of type ``gpu`` (one step on it alone)."""
  return sum(sum(unit_seconds(u, gpu, precision)) for u in profiles)


def calibrate_efficiency(gpu: GpuType, profiles: Sequence[UnitProfile], measured: Mapping[int, float],
                         precision: str = "fp32") -> GpuType:
  """Fits a GPU type's efficiency so that the roofline matches measured times.

  Args:
    gpu: the GPU type the times were measured on.
    profiles: the model's unit profiles.
    measured: unit index -> measured forward + backward seconds on ``gpu``.
    precision: "fp32", "fp16" or "bf16".

  Returns:
    ``gpu`` with ``efficiency`` = roofline time at efficiency 1 / measured time, over the measured units.
  """
  ideal = dataclasses.replace(gpu, efficiency=1.0, family_efficiency=())
  model = sum(sum(unit_seconds(profiles[u], ideal, precision)) for u in measured)
  return dataclasses.replace(gpu, efficiency=model / sum(measured.values()))
