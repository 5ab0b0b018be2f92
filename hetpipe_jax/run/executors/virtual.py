"""The ``virtual`` executor: real numerics on a virtual clock, the emulated cluster's time, bit for bit
the same for the same seed (:func:`hetpipe_jax.runtime.numerics.loops.run_virtual`)."""

from __future__ import annotations

from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.local import build
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import run_engine
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.loops import run_virtual


def run(setup: Setup) -> RunResult:
  cost = setup.task_cost
  return run_engine(setup, build(setup), lambda engine, resume, between: run_virtual(engine, cost, resume, between))


EXECUTOR = Executor("virtual", run, "runs on a virtual clock", precisions=PRECISIONS)
