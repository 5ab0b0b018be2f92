"""The ``wall`` executor: real numerics dispatched asynchronously on this host's devices, wall time,
optionally padded to the emulated speeds (:func:`hetpipe_jax.runtime.numerics.loops.run_wall`).

A padded run lasts at least ``time_scale`` x its emulated time; :func:`padding_seconds` bounds that
before anything runs, a run that would pad for more than :data:`MAX_PADDED_SECONDS` is refused, and a
long one is announced.
"""

from __future__ import annotations

import sys

from hetpipe_jax.core.schedule import BWD, FWD, Task
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.local import build
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import Runner, run_engine
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.loops import run_wall

MAX_PADDED_SECONDS = 24 * 3600.0  # a padded run that cannot finish in a day is refused
ANNOUNCE_SECONDS = 60.0  # a padded run at least this long says so first


def padding_seconds(setup: Setup) -> float:
  """A lower bound of a padded run's wall time: ``time_scale`` x the emulated time of its slowest virtual
  worker's bottleneck stage, busy for every minibatch (a forward and a backward each)."""
  cost, c = setup.task_cost, setup.config
  busiest = 0.0
  for i, vw in enumerate(setup.clock_layout.vws):
    per_mb = max(cost(Task(i, j, FWD, 1)) + cost(Task(i, j, BWD, 1)) for j in range(vw.k))
    busiest = max(busiest, per_mb * vw.nm * c.waves)
  return c.wall.time_scale * busiest


def check_padding(setup: Setup) -> None:
  """Refuses a padding that cannot finish; announces a long one on stderr.

  Raises:
    ConfigError: when the padded run would last more than :data:`MAX_PADDED_SECONDS`.
  """
  scale = setup.config.wall.time_scale
  if scale <= 0:
    return
  seconds = padding_seconds(setup)
  if seconds > MAX_PADDED_SECONDS:
    fits = scale * MAX_PADDED_SECONDS / seconds
    raise ConfigError(f"time_scale={scale:g} pads this run to at least {seconds:.3g} s of wall time (its emulated "
                      f"time x {scale:g}), over the {MAX_PADDED_SECONDS:.0f} s a padded run may take: use "
                      f"time_scale <= {fits:.3g}, fewer waves, or the virtual executor (the same clock, no "
                      "waiting)")
  if seconds >= ANNOUNCE_SECONDS:
    print(f"note: time_scale={scale:g} pads this run to at least {seconds:.0f} s of wall time", file=sys.stderr,
          flush=True)


def runner(setup: Setup) -> Runner:
  """Runs the engine on the wall clock, padded to the clock's task costs when ``time_scale`` > 0."""
  scale = setup.config.wall.time_scale
  cost = setup.task_cost if scale > 0 else None
  return lambda engine, resume, between: run_wall(engine, cost, scale, resume=resume, between=between)


def run(setup: Setup) -> RunResult:
  check_padding(setup)
  return run_engine(setup, build(setup), runner(setup))


EXECUTOR = Executor("wall", run, "runs on the wall clock", wall_options=True, precisions=PRECISIONS)
