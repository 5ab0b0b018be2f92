"""The in-process transport: pushes and pulls are immediate, tensors move with ``jax.device_put``.

Implements :class:`hetpipe_jax.core.comm.Comm` for the ``virtual`` and ``wall`` executors, where every
stage's device belongs to this process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from hetpipe_jax.core.comm import InstantComm, StageId
from hetpipe_jax.runtime.numerics.stage import Device


class DeviceComm(InstantComm):
  """Moves activations and gradients onto the receiving stage's JAX device.

  Args:
    devices: (virtual worker, stage) -> the JAX device of that stage.
  """

  def __init__(self, devices: Mapping[StageId, Device]):
    self._devices = dict(devices)

  def move(self, x: Any, src: StageId, dst: StageId) -> Any:
    del src
    return jax.device_put(x, self._devices[dst])
