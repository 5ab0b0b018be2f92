"""The cost profile of one unit (docs/PROTOCOL.md section 4): plain data, what every cost model reads.

Measured by :mod:`~hetpipe_jax.cost.profile`; timed by :mod:`~hetpipe_jax.cost.roofline`
(:func:`~hetpipe_jax.cost.roofline.unit_seconds`), sized by :mod:`~hetpipe_jax.cost.memory`, sent by
:mod:`~hetpipe_jax.cost.transfer`. Imports nothing of the package, so each of them can import it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class UnitProfile:
  """Cost of one unit at one batch size.

  Attributes:
    name: the unit's name.
    fwd_flops / bwd_flops: floating-point operations of the forward / backward pass.
    fwd_bytes / bwd_bytes: bytes of memory they access.
    param_bytes: the unit's parameters.
    out_bytes: its output activation (= the gradient sent back).
    kept_bytes: activation memory kept for the backward pass.
    family: the model's family, whose efficiency of a GPU type applies (vgg, resnet or default).
  """

  name: str
  fwd_flops: float
  bwd_flops: float
  fwd_bytes: float
  bwd_bytes: float
  param_bytes: int
  out_bytes: int
  kept_bytes: int
  family: str = "default"
