"""What the single-process executors with numerics (``virtual``, ``wall``) build: every stage on its GPU's
device, the virtual workers and their numerics, the parameter server on the host, compiled before the
clock starts."""

from __future__ import annotations

import jax

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.run.session import Built
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.device_comm import DeviceComm
from hetpipe_jax.runtime.numerics.mixed import compute_dtype
from hetpipe_jax.runtime.numerics.pipeline import PipelineNumerics
from hetpipe_jax.runtime.numerics.ps import ParameterServer
from hetpipe_jax.runtime.numerics.stage import Device, Stage, StageOptions


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
  devices = jax_devices(max(g.index for vw in layout.vws for j in range(vw.k) for g in vw.stage_gpus(j)) + 1)
  init_params = setup.init_params()
  stages = {(i, j): Stage(setup.model, units, init_params[units.start:units.stop],
                          [devices[g.index] for g in vw.stage_gpus(j)], setup.vw_tx(i), vw.nm,
                          StageOptions(c.wsp.weight_mode, c.precision, vw.stage_recompute(j), c.wsp.control))
            for i, vw in enumerate(layout.vws) for j, _, units in vw.stages()}
  comm = DeviceComm({key: stage.device for key, stage in stages.items()})  # a split stage's: whole on each
  numerics = [PipelineNumerics(i, [stages[(i, j)] for j in range(vw.k)], comm) for i, vw in enumerate(layout.vws)]
  server = ParameterServer(init_params, layout.num_vws, c.wsp.d, c.optim.server_rule(layout.num_vws, layout.nms),
                           on_nonfinite=c.optim.on_nonfinite, update_dtype=compute_dtype(c.precision))
  x0, y0 = batches(0, 1)
  for worker in numerics:  # compile before the clock starts
    worker.warm_up(x0, y0)
  server.warm_up()
  return Built(setup.virtual_workers(numerics), server, numerics, batches, init_params, devices[0])
