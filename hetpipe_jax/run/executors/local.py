"""What the single-process executors with numerics (``virtual``, ``wall``) build: every stage on its GPU's
device, the virtual workers and their numerics, the parameter server on the host, compiled before the
clock starts."""

from __future__ import annotations

import jax

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.run.session import Built
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.mixed import compute_dtype
from hetpipe_jax.runtime.ps import ParameterServer
from hetpipe_jax.runtime.stage import Device, Stage, StageOptions
from hetpipe_jax.runtime.transport import DeviceComm
from hetpipe_jax.runtime.worker import PipelineNumerics


def jax_devices(count: int) -> list[Device]:
  """The first ``count`` JAX devices (one per emulated GPU).

  Raises:
    ConfigError: when JAX has fewer, saying how to get more on CPU.
  """
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(
        f"this run places {count} emulated GPUs but JAX has {len(devices)} devices; on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts (experiments/train.py "
        "does it for you), or use fewer virtual workers or stages")
  return devices


def build(setup: Setup) -> Built:
  """The runtime of ``setup.layout`` on this process's devices, warmed up (see the module docstring)."""
  c, layout = setup.config, setup.layout
  check_memory(setup.profiles, layout, setup.costs)
  batches = setup.streams()
  devices = jax_devices(max(g.index for group in layout.gpus for g in group) + 1)
  init_params = setup.init_params()
  device_of = {(i, j): devices[gpu.index] for i, vw in enumerate(layout.vws) for j, gpu in enumerate(vw.gpus)}
  comm = DeviceComm(device_of)
  numerics = [PipelineNumerics(i, [Stage(setup.model, units, init_params[units.start:units.stop], device_of[(i, j)],
                                         setup.tx, vw.nm,
                                         StageOptions(c.wsp.weight_mode, c.precision, vw.stage_recompute(j)))
                                   for j, _, units in vw.stages()], comm)
              for i, vw in enumerate(layout.vws)]
  server = ParameterServer(init_params, layout.num_vws, c.wsp.d, c.optim.server_rule(layout.num_vws, layout.nms),
                           on_nonfinite=c.optim.on_nonfinite, update_dtype=compute_dtype(c.precision))
  x0, y0 = batches(0, 1)
  for worker in numerics:  # compile before the clock starts
    worker.warm_up(x0, y0)
  server.warm_up()
  return Built(setup.virtual_workers(numerics), server, numerics, batches, init_params, devices[0])
