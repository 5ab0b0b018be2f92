"""What every process of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`) builds its part from.

Every process builds the same :class:`Job` (the same seed gives the same initial weights everywhere), checks its
node against the cluster (:func:`check_node`), finds where every stage runs (:func:`nodes_of`, :func:`process_of`:
process i holds node i of the cluster's nodes in order) and compiles its own stages (:func:`build_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.controls import PER_MINIBATCH, Control
from hetpipe_jax.data import MinibatchStreams
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.runtime.numerics.mixed import cast_floats
from hetpipe_jax.runtime.numerics.ps import nonfinite_units
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions
from hetpipe_jax.runtime.transport.node import Node


class Job(NamedTuple):
  """What every process of a run needs to build its part.

  Attributes:
    model / streams / init_params: the model, every virtual worker's minibatches, its initial weights.
    layout / cluster: the run's layout on the cluster (process i holds node ``nodes[i]``).
    shard_nodes: the node of each unit's PS shard (:func:`hetpipe_jax.plan.placement.place_shards`).
    txs / weight_mode: each virtual worker's local optimizer (its stages'), the weight versions.
    d / ps_tx: the PS shards' clock bound and apply rule.
    precision: what the stages train in ("fp32", or "bf16"/"fp16": mixed precision,
      :mod:`hetpipe_jax.runtime.numerics.mixed`).
    control: the stages' staleness control (:mod:`hetpipe_jax.core.controls`).
  """

  model: LayeredModel
  streams: MinibatchStreams
  init_params: tuple[Any, ...]
  layout: Layout
  cluster: Cluster
  shard_nodes: Sequence[int]
  txs: tuple[optax.GradientTransformation, ...]
  weight_mode: str
  d: int
  ps_tx: optax.GradientTransformation | None
  precision: str = "fp32"
  control: Control = PER_MINIBATCH


def nodes_of(cluster: Cluster) -> list[int]:
  """The cluster's nodes in process order."""
  return sorted({g.node for g in cluster.gpus})


def process_of(layout: Layout, nodes: Sequence[int]) -> dict[tuple[int, int], int]:
  """(virtual worker, stage) -> the process of the node that holds its GPU (process i = ``nodes[i]``)."""
  index = {node: i for i, node in enumerate(nodes)}
  return {(i, j): index[gpu.node] for i, vw in enumerate(layout.vws) for j, gpu in enumerate(vw.gpus)}


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
                job.txs[i], vw.nm, StageOptions(job.weight_mode, job.precision, vw.stage_recompute(j), job.control))
  device = stage.device
  x = job.model.apply(job.init_params[:units.start], jnp.asarray(x0), 0, units.start)  # the stage's input
  if stage.dtype is not None and units.start > 0:  # a 16-bit activation from the previous stage
    x = cast_floats(x, stage.dtype)
  out = stage.warm_up(x, jax.device_put(y0, device) if stage.is_last else None)
  pushed = stage.dtype or jnp.float32  # compiles the check of a closed wave's update, as pushed
  nonfinite_units(jax.tree.map(lambda p: jnp.zeros_like(p, dtype=pushed), stage.params))
  specs = lambda arrays: [(a.shape, a.dtype) for a in arrays]  # (shapes are fixed)
  return stage, {"a": specs([x]), "g": specs(stage.gradient_arrays(stage.gradient_like(out)))}
