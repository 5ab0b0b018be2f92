"""The ``sim`` executor: the engine's schedule and WSP protocol on the cost model with shared links and
PS transfers, no numerics (:mod:`hetpipe_jax.sim`)."""

from __future__ import annotations

import time

from hetpipe_jax.core.trace import Trace, write_trace
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import require_pushes, trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.sim.replan import KEEP, Replanning, first_trace, segment_path, simulate_replanning
from hetpipe_jax.sim.simulate import SimJob
from hetpipe_jax.sim.simulate import run as simulate


def job(setup: Setup) -> SimJob:
  """What to simulate: the clock's model and layout."""
  c = setup.config
  return SimJob(setup.cluster, setup.clock_profiles, setup.clock_layout, c.wsp.d, c.waves, c.layout.placement,
                c.wsp.schedule, c.wsp.weight_mode, c.precision, c.sim, c.faults.by_vw(), c.faults.rejoin,
                c.wsp.control)


def replanning(config: RunConfig) -> Replanning:
  """HetPipe's re-planning rule of a run: every ``replan_every`` waves, Nm by the layout's rule (``keep`` for an
  explicit Nm: each virtual worker keeps its waves)."""
  nm = config.layout.nm
  return Replanning(every=config.sim.replan_every, nm_rule=nm if isinstance(nm, str) else KEEP)


def run(setup: Setup) -> RunResult:
  if setup.config.sim.adapting:
    return _replanning(setup)
  c, layout = setup.config, setup.clock_layout
  trace = Trace(c.trace_path, version=c.trace_version)
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
                    precisions=PRECISIONS, check=lambda config: config.sim.check_replan_every(config.sim.adapting))


def _replanning(setup: Setup) -> RunResult:
  """The run under HetPipe's adaptation (:mod:`hetpipe_jax.sim.replan`; Nm by the layout's rule, or each virtual
  worker keeping its waves): the first layout's trace at the trace path, the next ones beside it
  (``TRACE.layout2.jsonl``, ...), each a WSP run of its own; the metrics rows of all of them, their pushed
  images over the whole run's seconds.

  Raises:
    ConfigError: with ``fast_sim`` (its extrapolation is of one layout's settled waves) or injected failures.
  """
  c = setup.config
  if c.sim.fast or c.faults.failures:
    raise ConfigError("adapt (HetPipe's re-planning under noise) runs every wave of one layout after another: give "
                      "--adapt=off, or drop fast_sim and the injected failures")
  t_host = time.perf_counter()
  segments = simulate_replanning(job(setup), setup.costs, replanning(c), setup.fields, c.trace_version)
  events = first_trace(segments)
  if c.trace_path:
    for k, segment in enumerate(segments):
      write_trace(segment_path(c.trace_path, k), events if k == 0 else segment.trace.events)
  rows = [r for s in segments for r in s.rows]
  require_pushes(rows)
  last = segments[-1]
  return RunResult(None, None, events, rows, last.end, time.perf_counter() - t_host, last.vws, last.layout.cuts,
                   c.batch_size * sum(s.minibatches for s in segments))
