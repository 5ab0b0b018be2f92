"""The ``multiprocess`` executor: one process per node (:mod:`hetpipe_jax.runtime.processes`); every
process runs its node's part (:class:`~hetpipe_jax.runtime.processes.node_job.NodeJob`), process 0 also runs the
engine on the wall clock and returns the run's result (the others return an empty one)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
from absl import logging

from hetpipe_jax.core.merge import merge
from hetpipe_jax.core.trace import write_trace
from hetpipe_jax.errors import ConfigError, ProtocolError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.live_replan import Ran, run_adapting
from hetpipe_jax.run.executors.live_replan import check as check_adapting
from hetpipe_jax.run.executors.wall import runner
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import Built, require_pushes, run_engine, trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.metrics import replay_metrics
from hetpipe_jax.runtime.processes import job as processes_job
from hetpipe_jax.runtime.processes.channels import wait
from hetpipe_jax.runtime.processes.job import DecentralJob, Options
from hetpipe_jax.runtime.processes.node_job import Job, NodeJob, check_node, nodes_of
from hetpipe_jax.runtime.processes.remote import merge_records
from hetpipe_jax.runtime.transport.node import current_node


def job(setup: Setup, init_params, taken: Sequence[int] | None = None) -> Job:
  """What every process builds its part from (``taken``: the minibatches each virtual worker drew in earlier parts
  of the run)."""
  c = setup.config
  shard_nodes = place_shards(setup.cluster, setup.profiles, setup.layout, c.layout.placement)
  streams = setup.streams() if taken is None else setup.streams().after(taken)
  return Job(setup.model, streams, init_params, setup.layout, setup.cluster, shard_nodes, setup.tx,
             c.wsp.weight_mode, c.wsp.d, c.optim.server_rule(setup.layout.num_vws, setup.layout.nms),
             c.optim.on_nonfinite == "skip", c.precision)


def decentralised(setup: Setup) -> bool:
  """Whether the run is decentralised (:mod:`hetpipe_jax.runtime.processes.decentral`): every run but those that
  checkpoint or replace failed virtual workers, which still run one engine in process 0
  (:mod:`hetpipe_jax.runtime.processes.remote`)."""
  c = setup.config
  return not (c.checkpoint.directory or c.faults.rejoin)


def _options(setup: Setup, node, origin: float | None) -> Options:
  c = setup.config
  nodes = nodes_of(setup.cluster)
  for n, *_ in c.faults.slow:
    if n not in nodes:
      raise ConfigError(f"slow={n}:...: cluster {setup.cluster.name!r} has nodes {nodes[0]}..{nodes[-1]}")
  return Options(c.waves, c.wsp.schedule, c.eval_every, c.optim.on_nonfinite,
                 setup.task_cost if c.wall.time_scale > 0 else None, c.wall.time_scale,
                 f"{c.trace_path}.part{node.process}" if c.trace_path else None,
                 c.faults.slow_of(nodes[node.process]), origin,
                 tuple((vw, min(waves)) for vw, waves in sorted(c.faults.by_vw().items())))


class _Parts:
  """What the parts of a run share in a process: the compiled stages and PS copies
  (:data:`~hetpipe_jax.runtime.processes.job.Built`), the part running now (process 0's verdict on a lost process
  is that part's), and the compiling of a layout prepared while it trains."""

  def __init__(self):
    self.part: DecentralJob | None = None
    self.built: processes_job.Built = {}
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

  def wait(self) -> None:
    """Waits for the compiling :meth:`prepare` started (raising what it raised)."""
    if self._preparing is not None:
      self._preparing.join()
      self._preparing = None
    if self._failed:
      raise self._failed.pop()


def _run_part(setup: Setup, node, params, taken: Sequence[int] | None, origin: float | None, last: bool,
              parts: _Parts, prepare: Layout | None = None) -> tuple[Ran | None, float]:
  """One decentralised run (a part of the run, or all of it): process 0's :class:`Ran` (None elsewhere; its metrics
  not evaluated yet), and the run's origin (the first part's start, on this process's clock). ``prepare``: a layout
  whose stages and PS copies this process compiles while the part trains."""
  c = setup.config
  parts.wait()
  part = DecentralJob(node, job(setup, params, taken), _options(setup, node, origin), parts.built)
  parts.part = part
  part.start()
  if prepare is not None:
    ahead = dataclasses.replace(setup, layout=prepare, clock_layout=prepare)
    parts.prepare(DecentralJob(node, job(ahead, params, taken), _options(ahead, node, None), parts.built))
  origin = part.ctx.t_start if origin is None else origin
  start = part.ctx.t_start - origin
  outcome = part.finish(last)
  if outcome is None:
    return None, origin
  if outcome.missing and not last:
    raise RunStopped(f"processes {outcome.missing} were lost in a part of an adapting run, whose next layout needs "
                     "their GPUs: run with --adapt=off to go on without them")
  events, unplaced, dropped = merge(setup.meta_line(), outcome.parts)
  if unplaced:
    raise ProtocolError(f"{unplaced} trace events of a complete run could not be placed in causal order")
  if dropped:
    logging.info("trace: %d events of virtual workers after they left are unrecorded", dropped)
  if outcome.missing:
    logging.info("trace: processes %s were gone (their parts read back from their files, up to the last whole "
                 "line)", outcome.missing)
  metrics = replay_metrics(events, outcome.gathers, setup.layout.nms, c.waves, c.eval_every)
  require_pushes(metrics.rows)
  return Ran(events, metrics, outcome.gathers, start, start + outcome.seconds), origin


def _run_decentral(setup: Setup, node, init_params) -> RunResult:
  c, parts = setup.config, _Parts()
  if node.process == 0:  # a lost process's virtual workers leave (the clock says so), unless it held shards
    node.watch(lambda p: parts.part.ctx.fatal_loss(p) if parts.part is not None else None)
  if adapting(c):
    result = run_adapting(setup, node, init_params, lambda part, params, taken, origin, last, prepare: _run_part(
        part, node, params, taken, origin, last, parts, prepare))
    parts.wait()  # (nothing prepared is left compiling as the process ends)
    return result
  t_host = time.perf_counter()
  ran, _ = _run_part(setup, node, init_params, None, None, True, parts)
  if ran is None:
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  if c.trace_path:
    write_trace(c.trace_path, ran.events)
  rows = ran.metrics.finish(ran.gathers[-1], make_evaluator(setup.model, setup.data, jax.local_devices()[0]))
  return RunResult(init_params, ran.gathers[-1], ran.events, rows, ran.end, time.perf_counter() - t_host,
                   setup.virtual_workers(), setup.layout.cuts, trained_images(ran.events, c.batch_size))


def run(setup: Setup) -> RunResult:
  node = check_node(current_node(), setup.cluster)
  check_memory(setup.profiles, setup.layout, setup.costs)
  init_params = setup.init_params()  # the same in every process
  if decentralised(setup):
    return _run_decentral(setup, node, init_params)
  part = NodeJob(node, job(setup, init_params))
  part.start()
  if node.process != 0:
    part.wait()
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  server, numerics = part.controller()
  built = Built(setup.virtual_workers(numerics), server, numerics, None, init_params, jax.local_devices()[0])
  try:
    result = run_engine(setup, built, runner(setup, wait=wait))
  except (ConfigError, RunStopped):  # stopped on purpose (e.g. a non-finite update): every process ends cleanly
    node.stop_job()  # a command still waiting for what will never come gives up
    part.stop()
    raise
  # on any other failure nothing is cleaned up here: the process ends at once (Node.abort)
  merge_records(result.events, numerics)  # every process's own records of its tasks, into the one trace
  if setup.config.trace_path:
    write_trace(setup.config.trace_path, result.events)
  part.stop()
  return result


def adapting(config) -> bool:
  """Whether HetPipe adapts live (:mod:`hetpipe_jax.run.executors.live_replan`): ``adapt=on`` only (``auto``: the
  runtime does not know how its GPUs vary, so it keeps its layout)."""
  return config.sim.adapt == "on"


def _check(config) -> None:
  """``slow`` and ``adapt`` run in the decentralised runtime only (checkpointed and --rejoin runs take the central
  one); the live adaptation's own refusals (:func:`~hetpipe_jax.run.executors.live_replan.check`)."""
  central = config.checkpoint.directory or config.faults.rejoin
  config.sim.check_replan_every(adapting(config))
  if adapting(config):
    if central:
      raise ConfigError("adapt=on runs in the decentralised runtime, and checkpointed or --rejoin runs still take "
                        "the central one: drop adapt, or the checkpoints and --rejoin")
    if config.faults.failures:
      raise ConfigError("adapt=on starts every virtual worker again at each part, so a failed one would be back at "
                        "the next: drop adapt, or the injected failures (--fail)")
    check_adapting(config)
  if config.faults.slow and central:
    raise ConfigError("slow runs in the decentralised runtime, and checkpointed or --rejoin runs still take "
                      "the central one: drop slow, or the checkpoints and --rejoin")


EXECUTOR = Executor("multiprocess", run, "runs on the wall clock", wall_options=True, adapts=True,
                    placements=("default", "local"), precisions=PRECISIONS, slows=True, check=_check)
