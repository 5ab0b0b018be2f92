"""The ``sim`` executor: the engine's schedule and WSP protocol on the cost model with shared links and
PS transfers, no numerics (:mod:`hetpipe_jax.sim`)."""

from __future__ import annotations

import time

from hetpipe_jax.core.trace import Trace
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import require_pushes, trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.sim.simulate import SimJob
from hetpipe_jax.sim.simulate import run as simulate


def job(setup: Setup) -> SimJob:
  """What to simulate: the clock's model and layout."""
  c = setup.config
  return SimJob(setup.cluster, setup.clock_profiles, setup.clock_layout, c.wsp.d, c.waves, c.layout.placement,
                c.wsp.schedule, c.wsp.weight_mode, c.precision, c.sim, c.faults.by_vw(), c.faults.rejoin)


def run(setup: Setup) -> RunResult:
  c, layout = setup.config, setup.clock_layout
  trace = Trace(c.trace_path)
  t_host = time.perf_counter()
  try:
    seconds, vws, rows, fast = simulate(job(setup), trace, setup.fields)
  finally:
    trace.close()
  require_pushes(rows)
  images = (c.batch_size * c.waves * sum(layout.nms) if fast is not None
            else trained_images(trace.events, c.batch_size))
  return RunResult(None, None, trace.events, rows, seconds, time.perf_counter() - t_host, vws, layout.cuts,
                   images, fast_sim=fast)


EXECUTOR = Executor("sim", run, "has no numerics", numerics=False, sim_options=True, checkpoints=False,
                    precisions=PRECISIONS)
