"""One process's part of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`): the threads of
the stages and PS shards on its node, and on process 0 the engine's server and numerics adapters.

Every process builds the same :class:`Job` (the same seed gives the same initial weights everywhere),
starts its threads (:meth:`NodeJob.start`: compiled and connected before the clock starts, one barrier
for all), and either waits for the end (:meth:`NodeJob.wait`, processes other than 0) or, on process 0,
hands the engine its :meth:`NodeJob.controller` and stops every process at the end (:meth:`NodeJob.stop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.numerics.mixed import SCALED, cast_floats, compute_dtype
from hetpipe_jax.runtime.numerics.ps import nonfinite_units
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions
from hetpipe_jax.runtime.processes.channels import Channel, Wiring
from hetpipe_jax.runtime.processes.remote import RemoteNumerics, process_of
from hetpipe_jax.runtime.processes.shards import ShardedServer, ShardWorker
from hetpipe_jax.runtime.processes.stage_worker import StageWorker
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import TIMEOUT_S, Mailbox
from hetpipe_jax.runtime.transport.node import Node


class Job(NamedTuple):
  """What every process of a run needs to build its part.

  Attributes:
    model / streams / init_params: the model, every virtual worker's minibatches, its initial weights.
    layout / cluster: the run's layout on the cluster (process i holds node ``nodes[i]``).
    shard_nodes: the node of each unit's PS shard (:func:`hetpipe_jax.plan.placement.place_shards`).
    tx / weight_mode: the stages' local optimizer and weight versions.
    d / ps_tx / check_finite: the PS shards' clock bound and apply rule; whether a pushed update is checked
      for NaN or Inf before it is applied (``on_nonfinite="skip"``).
    precision: what the stages train in ("fp32", or "bf16"/"fp16": mixed precision,
      :mod:`hetpipe_jax.runtime.numerics.mixed`).
  """

  model: LayeredModel
  streams: MinibatchStreams
  init_params: tuple[Any, ...]
  layout: Layout
  cluster: Cluster
  shard_nodes: Sequence[int]
  tx: optax.GradientTransformation
  weight_mode: str
  d: int
  ps_tx: optax.GradientTransformation | None
  check_finite: bool
  precision: str = "fp32"


def nodes_of(cluster: Cluster) -> list[int]:
  """The cluster's nodes in process order."""
  return sorted({g.node for g in cluster.gpus})


def check_node(node: Node | None, cluster: Cluster) -> Node:
  """This process's node of the job, checked against the cluster.

  Raises:
    ConfigError: outside a job, or for a job with another number of processes than nodes.
  """
  nodes = nodes_of(cluster)
  if node is None:
    raise ConfigError("executor=multiprocess runs one process per node: start it with `python -m "
                      "experiments.train --executor=multiprocess` (it launches them), or join the job first")
  if node.num_processes != len(nodes):
    raise ConfigError(f"num_processes={node.num_processes} but cluster {cluster.name!r} has {len(nodes)} nodes; "
                      "run one process per node")
  return node


def build_stage(job: Job, i: int, j: int, x0, y0) -> tuple[Stage, dict[str, list[tuple[Any, Any]]]]:
  """Stage j of virtual worker i on its GPUs' local devices of this process (a split stage's partners are on
  its node), compiled on inputs like the run's (``x0``, ``y0``: a minibatch), and the (shape, dtype) of each
  array of what it receives: ``"a"``, its input activation, ``"g"``, the gradient of its output (in fp16, then
  the scale it is at)."""
  vw = job.layout.vws[i]
  units, gpu = vw.stage_units(j), vw.gpus[j]
  local = [g.index for g in job.cluster.node_gpus(gpu.node)]  # (a split stage's partners: the same node's)
  devices = [jax.local_devices()[local.index(g.index)] for g in vw.stage_gpus(j)]
  stage = Stage(job.model, units, job.init_params[units.start:units.stop], devices if len(devices) > 1 else devices[0],
                job.tx, vw.nm, StageOptions(job.weight_mode, job.precision, vw.stage_recompute(j)))
  device = stage.device
  x = job.model.apply(job.init_params[:units.start], jnp.asarray(x0), 0, units.start)  # the stage's input
  if stage.dtype is not None and units.start > 0:  # a 16-bit activation from the previous stage
    x = cast_floats(x, stage.dtype)
  out = stage.warm_up(x, jax.device_put(y0, device) if stage.is_last else None)
  pushed = stage.dtype or jnp.float32  # compiles the check of a closed wave's update, as pushed
  nonfinite_units(jax.tree.map(lambda p: jnp.zeros_like(p, dtype=pushed), stage.params))
  specs = lambda arrays: [(a.shape, a.dtype) for a in arrays]  # (shapes are fixed)
  return stage, {"a": specs([x]), "g": specs(stage.gradient_arrays(stage.gradient_like(out)))}


class NodeJob:
  """This process's threads of ``job`` (see the module docstring)."""

  def __init__(self, node: Node, job: Job):
    self.node, self.job = node, job
    self.nodes = nodes_of(job.cluster)
    self.owners = process_of(job.layout, self.nodes)
    self.shard_owners = [self.nodes.index(n) for n in job.shard_nodes]
    self.mailbox = Mailbox()
    self.wiring = Wiring(node, self.owners, self.shard_owners, self.mailbox)
    self.threads: list[Any] = []
    self.channels: dict[int, Channel] = {}
    self.numerics: list[RemoteNumerics] = []

  def _stage_worker(self, i: int, j: int, x0, y0) -> StageWorker:
    """Stage j of virtual worker i on its GPU's local device, compiled on inputs like the run's."""
    stage, inputs = build_stage(self.job, i, j, x0, y0)
    return StageWorker(self.wiring, i, j, stage, self.job.layout.vws[i].nm, self.job.streams, inputs)

  def start(self) -> None:
    """Builds and starts this process's stage and shard threads; returns once every process has."""
    job, me = self.job, self.node.process
    mine = [u for u, p in enumerate(self.shard_owners) if p == me]
    if mine:  # this process holds these units' PS shards, in host memory
      self.threads.append(ShardWorker(self.wiring, mine, [job.init_params[u] for u in mine], job.layout.cuts,
                                      job.layout.num_vws, job.d, job.ps_tx, compute_dtype(job.precision)).thread)
    x0, y0 = job.streams(0, 1)
    for (i, j), process in self.owners.items():
      if process == me:
        self.threads.append(self._stage_worker(i, j, x0, y0).thread)
    self.node.connect_all()
    for thread in self.threads:
      thread.start()
    self.node.barrier("hetpipe_jax/ready", 600)  # every stage compiled and connected before the clock starts

  def wait(self) -> None:
    """A process other than 0: runs its threads to the end of the job."""
    for thread in self.threads:
      thread.join()
    self.node.close()

  def on_gone(self, p: int) -> str | None:
    """Why the job cannot go on without process ``p`` (it held PS shards), or None (its virtual workers
    leave)."""
    units = [u for u, owner in enumerate(self.shard_owners) if owner == p]
    return None if not units else (
        f"process {p} (node {self.nodes[p]}) is gone, and with it the PS shards of units {units}: the global "
        "weights are lost; resume from the newest checkpoint (--checkpoint_dir with --resume), or keep the "
        "shards off nodes that may fail (--placement)")

  def controller(self) -> tuple[ShardedServer, list[RemoteNumerics]]:
    """Process 0: the engine's server (the WSP clocks; the weights stay with the shards' owners) and one
    numerics adapter per virtual worker (commands to the stages' processes)."""
    job, node = self.job, self.node
    node.watch(self.on_gone)
    self.channels = {p: Channel(node, f"ps{p}", p, f"the PS shards of process {p}", protocol.SHARD_OPS)
                     for p in sorted(set(self.shard_owners))}
    server = ShardedServer(node, job.layout.num_vws, job.d, self.shard_owners, self.channels, self.mailbox,
                           [jax.tree.structure(p) for p in job.init_params])
    self.numerics = [RemoteNumerics(self.wiring, i, vw.cuts, vw.nm, self.channels, check_finite=job.check_finite,
                                    scaled=job.precision in SCALED)
                     for i, vw in enumerate(job.layout.vws)]
    return server, self.numerics

  def stop(self) -> None:
    """Process 0, at the end: every command posted so far is executed first, then every thread ends."""
    for n in self.numerics:
      n.stop()
    for channel in self.channels.values():
      channel.post(op="stop")
    for thread in self.threads:
      thread.join(timeout=TIMEOUT_S)  # a thread still waiting for a lost process is left behind
    self.node.close()
