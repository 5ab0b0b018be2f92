"""The numeric precisions a run is costed in, by name: bytes per element and which peak applies.

Mixed precision as in Micikevicius et al., "Mixed Precision Training" (ICLR 2018): the forward and
backward passes run in a 16-bit format (fp16, or bfloat16), weights and gradients are held in it, and
the optimizer updates an fp32 master copy of the weights with fp32 state. One registry serves the
roofline (which peak: :meth:`hetpipe_jax.cluster.GpuType.peak_flops`, and how many bytes a pass moves),
the memory model (:mod:`hetpipe_jax.cost.memory`) and the transfers (:mod:`hetpipe_jax.cost.transfer`,
the simulator's pushes). Profiles are measured in fp32; a precision scales their byte counts by
:func:`byte_scale`::

  element_bytes("bf16")   # 2
  byte_scale("fp16")      # 0.5: bytes of an fp16 tensor per byte of the fp32 one
"""

from __future__ import annotations

from hetpipe_jax.errors import ConfigError

# Bytes per element of the weights, gradients and activations a pass computes in.
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
PRECISIONS = tuple(ELEMENT_BYTES)
FP32_BYTES = 4  # the profiles' element size, and the master weights' and optimizer state's


def check_precision(precision: str) -> str:
  """Returns ``precision`` if it is known.

  Raises:
    ConfigError: for an unknown name, listing the known ones.
  """
  if precision not in ELEMENT_BYTES:
    raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)} (fp16/bf16: "
                      "mixed precision with fp32 master weights)")
  return precision


def element_bytes(precision: str) -> int:
  """Bytes per element of tensors computed in ``precision`` (4 for fp32, 2 for fp16 and bf16).

  Raises:
    ConfigError: for an unknown precision.
  """
  return ELEMENT_BYTES[check_precision(precision)]


def byte_scale(precision: str) -> float:
  """Bytes of a tensor in ``precision`` per byte of the same tensor in fp32 (1.0, or 0.5 for 16 bits).

  Raises:
    ConfigError: for an unknown precision.
  """
  return element_bytes(precision) / FP32_BYTES


def is_mixed(precision: str) -> bool:
  """Whether ``precision`` trains in 16 bits with fp32 master weights (fp16, bf16)."""
  return element_bytes(precision) < FP32_BYTES
