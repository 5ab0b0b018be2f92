"""The ``multiprocess`` executor: one process per node (:mod:`hetpipe_jax.runtime.multiprocess`); every
process runs its node's part (:class:`~hetpipe_jax.runtime.node_job.NodeJob`), process 0 also runs the
engine on the wall clock and returns the run's result (the others return an empty one)."""

from __future__ import annotations

import jax

from hetpipe_jax.core.trace import write_trace
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.run.executors.base import Executor
from hetpipe_jax.run.executors.wall import runner
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.session import Built, run_engine
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.channels import wait
from hetpipe_jax.runtime.distributed import current_node
from hetpipe_jax.runtime.node_job import Job, NodeJob, check_node
from hetpipe_jax.runtime.remote import merge_records


def job(setup: Setup, init_params) -> Job:
  """What every process builds its part from."""
  c = setup.config
  shard_nodes = place_shards(setup.cluster, setup.profiles, setup.layout, c.layout.placement)
  return Job(setup.model, setup.streams(), init_params, setup.layout, setup.cluster, shard_nodes, setup.tx,
             c.wsp.weight_mode, c.wsp.d, c.optim.ps_tx, c.optim.on_nonfinite == "skip")


def run(setup: Setup) -> RunResult:
  node = check_node(current_node(), setup.cluster)
  check_memory(setup.profiles, setup.layout, setup.costs)
  init_params = setup.init_params()  # the same in every process
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


EXECUTOR = Executor("multiprocess", run, "runs on the wall clock", wall_options=True,
                    placements=("default", "local"))
