"""The ``multiprocess`` executor: one process per node (:mod:`hetpipe_jax.runtime.multiprocess`); every
process runs its node's part (:class:`~hetpipe_jax.runtime.node_job.NodeJob`), process 0 also runs the
engine on the wall clock and returns the run's result (the others return an empty one)."""

from __future__ import annotations

import time

import jax
from absl import logging

from hetpipe_jax.core.merge import merge
from hetpipe_jax.core.trace import write_trace
from hetpipe_jax.errors import ConfigError, ProtocolError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.precision import PRECISIONS
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.wall import runner
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import Built, require_pushes, run_engine, trained_images
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.channels import wait
from hetpipe_jax.runtime.decentral_job import DecentralJob, Options
from hetpipe_jax.runtime.distributed import current_node
from hetpipe_jax.runtime.metrics import replay_metrics
from hetpipe_jax.runtime.node_job import Job, NodeJob, check_node, nodes_of
from hetpipe_jax.runtime.remote import merge_records


def job(setup: Setup, init_params) -> Job:
  """What every process builds its part from."""
  c = setup.config
  shard_nodes = place_shards(setup.cluster, setup.profiles, setup.layout, c.layout.placement)
  return Job(setup.model, setup.streams(), init_params, setup.layout, setup.cluster, shard_nodes, setup.tx,
             c.wsp.weight_mode, c.wsp.d, c.optim.server_rule(setup.layout.num_vws, setup.layout.nms),
             c.optim.on_nonfinite == "skip", c.precision)


def decentralised(setup: Setup) -> bool:
  """Whether the run is decentralised (:mod:`hetpipe_jax.runtime.decentral`): every run but those that
  checkpoint or inject failures, which still run one engine in process 0 (:mod:`hetpipe_jax.runtime.remote`)."""
  c = setup.config
  return not (c.checkpoint.directory or c.faults.failures or c.faults.rejoin)


def _run_decentral(setup: Setup, node, init_params) -> RunResult:
  c = setup.config
  nodes = nodes_of(setup.cluster)
  for n, *_ in c.faults.slow:
    if n not in nodes:
      raise ConfigError(f"slow={n}:...: cluster {setup.cluster.name!r} has nodes {nodes[0]}..{nodes[-1]}")
  options = Options(c.waves, c.wsp.schedule, c.eval_every, c.optim.on_nonfinite,
                    setup.task_cost if c.wall.time_scale > 0 else None, c.wall.time_scale,
                    f"{c.trace_path}.part{node.process}" if c.trace_path else None,
                    c.faults.slow_of(nodes[node.process]))
  part = DecentralJob(node, job(setup, init_params), options)
  if node.process == 0:  # a lost process's virtual workers leave (the clock says so), unless it held shards
    node.watch(part.ctx.fatal_loss)
  t_host = time.perf_counter()
  part.start()
  outcome = part.finish()
  if outcome is None:
    return RunResult(None, None, [], [], 0.0, 0.0, [], setup.layout.cuts, 0)
  meta = setup.meta_line()
  events, unplaced, dropped = merge(meta, outcome.parts)
  if unplaced:
    raise ProtocolError(f"{unplaced} trace events of a complete run could not be placed in causal order")
  if dropped or outcome.missing:
    logging.info("trace: %d events of virtual workers that left are unrecorded; processes %s were gone (their "
                 "parts read back from their files, up to the last whole line)", dropped, outcome.missing)
  if c.trace_path:
    write_trace(c.trace_path, events)
  evaluate = make_evaluator(setup.model, setup.data, jax.local_devices()[0])
  rows = replay_metrics(events, outcome.gathers, setup.layout.nms, c.waves, c.eval_every)
  require_pushes(rows.rows)
  final = outcome.gathers[-1]
  return RunResult(init_params, final, events, rows.finish(final, evaluate), outcome.seconds,
                   time.perf_counter() - t_host, setup.virtual_workers(), setup.layout.cuts,
                   trained_images(events, c.batch_size))


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


def _check(config) -> None:
  """``slow`` runs in the decentralised runtime only (checkpointed and fault-injected runs take the central one)."""
  if config.faults.slow and (config.checkpoint.directory or config.faults.failures or config.faults.rejoin):
    raise ConfigError("slow runs in the decentralised runtime, and checkpointed or --fail/--rejoin runs still take "
                      "the central one: drop slow, or the checkpoints and injected failures")


EXECUTOR = Executor("multiprocess", run, "runs on the wall clock", wall_options=True,
                    placements=("default", "local"), precisions=PRECISIONS, slows=True, check=_check)
