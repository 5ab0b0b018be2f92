"""One run of the engine with numerics: its trace, checkpoints, metrics and evaluation around an executor.

Every executor that computes (``virtual``, ``wall``, ``multiprocess``) builds its virtual workers, server
and numerics (:class:`Built`) and hands them here with how it runs the engine (a :data:`Runner`);
:func:`run_engine` writes the trace's meta line (or resumes the trace of a checkpoint), runs, evaluates
and returns the :class:`~hetpipe_jax.run.result.RunResult`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from hetpipe_jax.core import wsp
from hetpipe_jax.core.breakdown import pushed_images
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.errors import ConfigError, NonFiniteUpdate, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.checkpoint import Checkpointer
from hetpipe_jax.runtime.numerics.loops import Checkpointing, VirtualClock
from hetpipe_jax.runtime.numerics.metrics import WaveMetrics

# How an executor runs the engine: (engine, the clock to resume from or None, checkpointing or None) ->
# seconds on its clock.
Runner = Callable[[Engine, VirtualClock | None, Checkpointing | None], float]


@dataclasses.dataclass(frozen=True)
class Built:
  """What an executor built for the engine: virtual workers, the server (which has the global ``params``
  and the clocks), the numerics whose state a checkpoint holds, the minibatch streams (None where the
  stages read their own), the initial weights and the device that evaluates."""

  vws: list[VirtualWorker]
  server: Any
  numerics: Sequence[Any]
  batches: Any
  init_params: tuple[Any, ...]
  eval_device: Any


def require_pushes(rows: Sequence[dict[str, Any]]) -> None:
  """Raises RunStopped when no wave reached the parameter server (every virtual worker failed first)."""
  if not rows:
    raise RunStopped("every virtual worker failed before pushing a wave, so nothing was trained; inject "
                     "failures at later waves, or let replacements join (rejoin)")


def trained_images(events: Sequence[dict[str, Any]], batch_size: int) -> int:
  """Images in the waves pushed to the parameter server (work a failure dropped does not count)."""
  return sum(pushed_images(events, batch_size))


def identity(setup: Setup, meta: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint's run is: a resume must match every entry (the meta line names a ``ps_optimizer``
  other than ``add``; a custom ``ps_tx`` counts as ``custom_tx``)."""
  c, opt = setup.config, setup.config.optim
  return {**{k: v for k, v in meta.items() if k not in ("ev", "version")},
          "optimizer": opt.name, "learning_rate": opt.learning_rate, "waves": c.waves, "eval_every": c.eval_every,
          "drop_remainder": c.drop_remainder, "on_nonfinite": opt.on_nonfinite, "rejoin": c.faults.rejoin,
          "custom_tx": opt.tx is not None or opt.ps_tx is not None}


class _Checkpoints:
  """A run's checkpoints (:class:`~hetpipe_jax.run.config.CheckpointSpec`): the newest one to resume
  from (``state``), and a save at every due global clock tick."""

  def __init__(self, setup: Setup, meta: dict[str, Any]):
    spec = setup.config.checkpoint
    assert spec.directory is not None
    self.checkpointer = Checkpointer(spec.directory, spec.every, spec.keep, identity(setup, meta))
    self.state: dict[str, Any] | None = None
    if spec.resume:
      step = self.checkpointer.latest()
      if step is None:
        raise ConfigError(f"resume: no complete checkpoint in {spec.directory}; run without resume to start "
                          "afresh")
      state, _ = self.checkpointer.restore(step)
      self.state = {**state, "step": step}

  def restore(self, engine: Engine, built: Built, metrics: WaveMetrics) -> VirtualClock | None:
    """Restores the engine, server, numerics and metrics; returns the executor's clock to resume from."""
    if self.state is None:
      return None
    engine.restore(self.state["engine"])
    built.server.restore_checkpoint_state(self.state["server"])
    for worker, worker_state in zip(built.numerics, self.state["numerics"]):
      worker.restore_checkpoint_state(worker_state)
    metrics.restore_checkpoint_state(self.state["metrics"])
    return VirtualClock(**self.state["clock"])

  def between(self, engine: Engine, built: Built, metrics: WaveMetrics, trace: Trace,
              evaluate: Callable[[Any], dict[str, float]]) -> Checkpointing:
    """When a checkpoint is due and how the executor saves one."""
    server = built.server

    def save(clock: VirtualClock) -> None:
      trace.flush()
      self.checkpointer.save(wsp.c_global(server.clock), {
          "engine": engine.state, "server": server.checkpoint_state(),
          "numerics": [worker.checkpoint_state() for worker in built.numerics],
          "metrics": metrics.checkpoint_state(evaluate), "trace_events": len(trace.events),
          "clock": {"t": clock.t, "heap": list(clock.heap), "seq": clock.seq}}, {"virtual_time": clock.t})

    return Checkpointing(lambda: self.checkpointer.due(wsp.c_global(server.clock)), save)

  def stats(self) -> dict[str, Any]:
    c = self.checkpointer
    return {"directory": c.directory, "saved": len(c.seconds), "seconds": c.seconds, "bytes": c.bytes,
            "resumed_from": None if self.state is None else self.state["step"]}


def _open_trace(setup: Setup, meta: dict[str, Any], checkpoints: _Checkpoints | None) -> Trace:
  """A new trace with ``meta`` first, or the trace a resumed checkpoint continues."""
  if checkpoints is None or checkpoints.state is None:
    trace = Trace(setup.config.trace_path, version=setup.config.trace_version)
    trace.emit(**meta)
    return trace
  assert setup.config.trace_path is not None  # CheckpointSpec.validate asks for it
  return Trace.resume(setup.config.trace_path, checkpoints.state["trace_events"], setup.config.trace_version)


def run_engine(setup: Setup, built: Built, run: Runner) -> RunResult:
  """Writes the trace, runs the engine with ``run``, evaluates the global weights, returns the result
  (with checkpoints saved, or resumed from, as ``setup.config.checkpoint`` says)."""
  config, layout = setup.config, setup.layout
  meta = setup.meta_line()
  evaluate = make_evaluator(setup.model, setup.data, built.eval_device)
  checkpoints = _Checkpoints(setup, meta) if config.checkpoint.directory else None
  trace = _open_trace(setup, meta, checkpoints)
  metrics = WaveMetrics(built.server, layout.nms, config.waves, config.eval_every)
  engine = Engine(built.vws, built.server, trace, built.batches, metrics.on_wave, failures=config.faults.by_vw(),
                  rejoin=config.faults.rejoin)
  resume = between = None
  if checkpoints is not None:
    resume = checkpoints.restore(engine, built, metrics)
    between = checkpoints.between(engine, built, metrics, trace, evaluate)
  t_host = time.perf_counter()
  try:
    seconds = run(engine, resume, between)
    final = built.server.params
    jax.block_until_ready(final)
  except NonFiniteUpdate as e:  # name the stage too, for the user
    raise e.with_stages(layout.cuts[e.vw]) from None
  finally:
    trace.close()
    if checkpoints is not None:
      checkpoints.checkpointer.close()
  wall_seconds = time.perf_counter() - t_host
  require_pushes(metrics.rows)
  rows = metrics.finish(final, evaluate)
  images = trained_images(trace.events, config.batch_size)
  return RunResult(built.init_params, final, trace.events, rows, seconds, wall_seconds, built.vws, layout.cuts,
                   images, None if checkpoints is None else checkpoints.stats())
