"""The ``multiprocess`` executor: one process per node (:mod:`hetpipe_jax.runtime.processes`), a decentralised run
(:class:`~hetpipe_jax.runtime.processes.job.DecentralJob`): every process runs its node's stages and PS copies, and
process 0 also the WSP clock; process 0 merges the trace, evaluates and returns the run's result (the others return
an empty one). A run goes in parts (:mod:`~hetpipe_jax.run.executors.parts`) when HetPipe adapts live
(:mod:`~hetpipe_jax.run.executors.live_replan`) or it keeps checkpoints or replaces failed virtual workers
(:mod:`~hetpipe_jax.run.executors.continued`)."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Sequence

import jax
from absl import logging

from hetpipe_jax.core.merge import merge
from hetpipe_jax.core.trace import write_trace
from hetpipe_jax.errors import ConfigError, LostAtStart, ProtocolError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.continued import check as check_continued
from hetpipe_jax.run.executors.continued import continuing, run_continued
from hetpipe_jax.run.executors.live_replan import check as check_adapting
from hetpipe_jax.run.executors.live_replan import run_adapting
from hetpipe_jax.run.executors.parts import PartAt, Ran, part_metrics
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.processes import job as processes_job
from hetpipe_jax.runtime.processes.build import Job, check_node, nodes_of
from hetpipe_jax.runtime.processes.job import DecentralJob, Options
from hetpipe_jax.runtime.transport.node import current_node


def job(setup: Setup, init_params, taken: Sequence[int] | None = None) -> Job:
  """What every process builds its part from (``taken``: the minibatches each virtual worker drew in earlier parts
  of the run)."""
  c = setup.config
  shard_nodes = place_shards(setup.cluster, setup.profiles, setup.layout, c.layout.placement)
  streams = setup.streams() if taken is None else setup.streams().after(taken)
  return Job(setup.model, streams, init_params, setup.layout, setup.cluster, shard_nodes,
             tuple(setup.vw_tx(i) for i in range(setup.layout.num_vws)),
             c.wsp.weight_mode, c.wsp.d, c.optim.server_rule(setup.layout.num_vws, setup.layout.nms), c.precision,
             c.wsp.control)


def _options(setup: Setup, node, origin: float | None, at: PartAt) -> Options:
  c = setup.config
  nodes = nodes_of(setup.cluster)
  for n, *_ in c.faults.slow:
    if n not in nodes:
      raise ConfigError(f"slow={n}:...: cluster {setup.cluster.name!r} has nodes {nodes[0]}..{nodes[-1]}")
  return Options(c.waves, c.wsp.schedule, c.eval_every, c.optim.on_nonfinite,
                 setup.task_cost if c.wall.time_scale > 0 else None, c.wall.time_scale,
                 f"{c.trace_path}.part{node.process}" if c.trace_path else None,
                 c.faults.slow_of(nodes[node.process]), origin,
                 tuple((vw, min(waves)) for vw, waves in sorted(c.faults.by_vw().items())), c.faults.rejoin,
                 (at.first, at.run_waves or c.waves), at.before)


WHOLE = PartAt()  # a run that is all of it (or a part whose trace stands alone)


class _Parts:
  """What the parts of a run share in a process: the compiled stages and PS copies
  (:data:`~hetpipe_jax.runtime.processes.job.Built`), the part running now (process 0's verdict on a lost process
  is that part's), and the compiling of a layout prepared while it trains."""

  def __init__(self):
    self.origin: float | None = None  # when the first part started, on this process's clock
    self.part: DecentralJob | None = None
    self.built: processes_job.Built = {}
    self.stranded: list[threading.Thread] = []  # earlier parts' threads still waiting inside the transport
    self._preparing: threading.Thread | None = None
    self._failed: list[BaseException] = []

  def prepare(self, part: DecentralJob) -> None:
    """Compiles ``part`` (:meth:`DecentralJob.compile`) in the background."""

    def body() -> None:
      try:
        part.compile()
      except BaseException as e:  # pylint: disable=broad-except  # raised again by wait
        self._failed.append(e)

    self._preparing = threading.Thread(target=body, name="prepare", daemon=True)
    self._preparing.start()

  def stop(self, node) -> None:
    """The run stopped between two parts: process 0 tells the others (each waits for what the next part starts
    from), and every process closes; one other than 0 then ends at once (its earlier parts' waits inside the
    transport would abort Python's teardown), process 0 gives its own 2 s to fail with their senders gone."""
    if node.process == 0:
      node.stop_job()
    node.close()
    if node.process != 0:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(0)
    for thread in self.stranded:
      thread.join(2.0)

  def wait(self) -> None:
    """Waits for the compiling :meth:`prepare` started (raising what it raised)."""
    if self._preparing is not None:
      self._preparing.join()
      self._preparing = None
    if self._failed:
      raise self._failed.pop()


def _run_part(setup: Setup, node, params, taken: Sequence[int] | None, last: bool, parts: _Parts,
              prepare: Layout | None = None, at: PartAt = WHOLE) -> Ran | None:
  """One decentralised run (a part of the run, or all of it, ``at`` its place): process 0's :class:`Ran` (None
  elsewhere). ``prepare``: a layout whose stages and PS copies this process compiles
  while the part trains."""
  parts.wait()
  part = DecentralJob(node, job(setup, params, taken), _options(setup, node, parts.origin, at), parts.built,
                      parts.stranded)
  parts.part = part
  part.start()
  if prepare is not None:
    ahead = dataclasses.replace(setup, layout=prepare, clock_layout=prepare)
    parts.prepare(DecentralJob(node, job(ahead, params, taken), _options(ahead, node, None, WHOLE), parts.built))
  parts.origin = part.ctx.t_start if parts.origin is None else parts.origin
  start = part.ctx.t_start - parts.origin
  outcome = part.finish(last)
  if outcome is None:
    return None
  events, unplaced, dropped = merge(setup.meta_line(), outcome.parts)
  if unplaced:
    raise ProtocolError(f"{unplaced} trace events of a complete run could not be placed in causal order")
  if dropped:
    logging.info("trace: %d events of virtual workers after they left are unrecorded", dropped)
  if outcome.missing:
    logging.info("trace: processes %s were gone (their parts read back from their files, up to the last whole "
                 "line)", outcome.missing)
  return Ran(events, outcome.gathers, start, start + outcome.seconds, tuple(outcome.missing))


def _run_decentral(setup: Setup, node, init_params) -> RunResult:
  c, parts = setup.config, _Parts()
  if node.process == 0:  # a lost process's virtual workers leave (the clock says so), unless it held shards
    node.watch(lambda p: parts.part.ctx.fatal_loss(p) if parts.part is not None else None)
  if adapting(c) or continuing(c):
    run_in_parts = run_adapting if adapting(c) else run_continued
    try:
      result = run_in_parts(setup, node, init_params, lambda part, params, taken, last, prepare, at: _run_part(
          part, node, params, taken, last, parts, prepare, at))
    except RunStopped:
      parts.stop(node)
      raise
    parts.wait()  # (nothing prepared is left compiling as the process ends)
    return result
  t_host = time.perf_counter()
  try:
    ran = _run_part(setup, node, init_params, None, True, parts)
  except LostAtStart:
    parts.stop(node)
    raise
  if ran is None:
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  if c.trace_path:
    write_trace(c.trace_path, ran.events)
  evaluate = make_evaluator(setup.model, setup.data, jax.local_devices()[0])
  rows = part_metrics(setup, ran).finish(ran.gathers[-1], evaluate)
  return RunResult(init_params, ran.gathers[-1], ran.events, rows, ran.end, time.perf_counter() - t_host,
                   setup.virtual_workers(), setup.layout.cuts, trained_images(ran.events, c.batch_size))


def run(setup: Setup) -> RunResult:
  node = check_node(current_node(), setup.cluster)
  check_memory(setup.profiles, setup.layout, setup.costs)
  return _run_decentral(setup, node, setup.init_params())  # (the initial weights: the same in every process)


def adapting(config) -> bool:
  """Whether HetPipe adapts live (:mod:`hetpipe_jax.run.executors.live_replan`): ``adapt=on`` only (``auto``: the
  runtime does not know how its GPUs vary, so it keeps its layout)."""
  return config.sim.adapt == "on"


def _check(config) -> None:
  """The refusals of the runs in parts: the live adaptation's (:func:`~hetpipe_jax.run.executors.live_replan.check`)
  and those of checkpointed and --rejoin runs (:func:`~hetpipe_jax.run.executors.continued.check`)."""
  config.sim.check_replan_every(adapting(config))
  if adapting(config):
    if continuing(config):
      raise ConfigError("adapt=on re-plans between parts that each start the trace anew, and a checkpointed or "
                        "--rejoin run continues one trace over its parts: drop adapt, or the checkpoints and --rejoin")
    if config.faults.failures:
      raise ConfigError("adapt=on starts every virtual worker again at each part, so a failed one would be back at "
                        "the next: drop adapt, or the injected failures (--fail)")
    check_adapting(config)
  elif continuing(config):
    check_continued(config)


EXECUTOR = Executor("multiprocess", run, "runs on the wall clock", wall_options=True, adapts=True,
                    placements=("default", "local"), precisions=PRECISIONS, slows=True, check=_check,
                    trace_versions=(1,))  # (its PS shards apply pushes in their own orders: no one seq names a base)
