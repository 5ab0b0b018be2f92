"""The peers by name: what ``experiments.baseline --system=NAME``, the studies and the tuner simulate.

A new peer is one module in :mod:`hetpipe_jax.baselines` with a ``*_job`` builder, and one entry of
:data:`SYSTEMS`. Every peer runs on :func:`hetpipe_jax.baselines.sync.simulate_sync`: the same cost model,
catalogue, links and shared-flow network as HetPipe's ``sim`` executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from hetpipe_jax.baselines.gpipe import gpipe_job
from hetpipe_jax.baselines.hetero_dp import hetero_dp_job
from hetpipe_jax.baselines.horovod import horovod_job
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.local_sgd import local_sgd_job
from hetpipe_jax.baselines.ps_sync import ps_replicated_job, ps_sync_job
from hetpipe_jax.baselines.sync import SyncJob, simulate_sync
from hetpipe_jax.baselines.sync_pipeline import sync_pipeline_job
from hetpipe_jax.baselines.tf_replicated import tf_replicated_copy_job, tf_replicated_job
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.errors import ConfigError


class System(NamedTuple):
  """A peer: its builder and a line on what it is."""

  build: Callable[[Cluster, BatchProfiles, int, PeerKnobs, CostContext], SyncJob]
  summary: str


SYSTEMS: dict[str, System] = {
    "horovod": System(horovod_job, "equal batches on every GPU that holds the model, fused ring all-reduce "
                      "overlapped with the backward pass"),
    "hetero_dp": System(hetero_dp_job, "per-GPU batch in proportion to speed under each GPU's memory, gradient "
                        "accumulation, one weighted fused all-reduce"),
    "sync_pipeline": System(sync_pipeline_job, "the planner's pipelines, microbatches in proportion to speed, 1F1B "
                            "with a flush, gradients all-reduced across pipelines"),
    "local_sgd": System(local_sgd_job, "H local steps per worker, then an all-reduce of the weight change and an "
                        "outer Nesterov step (DiLoCo)"),
    "ps_sync": System(ps_sync_job, "TensorFlow's synchronous parameter server: variables round-robin over one PS "
                      "task per worker host, every worker pushes every gradient and pulls every variable a step"),
    "ps_replicated": System(ps_replicated_job, "ps_sync with each host's GPUs as one worker: gradients summed "
                            "inside the host, one push and one pull per host (distributed_replicated)"),
    "tf_replicated": System(tf_replicated_job, "TensorFlow's replicated variables with NCCL: every unit's gradient "
                            "all-reduced on its own after the backward pass"),
    "gpipe": System(gpipe_job, "one pipeline over every GPU in order, cuts balanced by compute, every forward "
                    "then every backward, checkpointed activations, a flush (GPipe, torchgpipe)"),
    "tf_replicated_copy": System(tf_replicated_copy_job, "TensorFlow's replicated variables without NCCL: every "
                                 "variable summed on one device by copies after the backward pass, copied back"),
}


DEFAULT_KNOBS = PeerKnobs()


class PeerRun(NamedTuple):
  """A simulated peer.

  Attributes:
    job: what ran.
    round_seconds: seconds of one round (a step; local_sgd: H local steps and the synchronisation).
    examples_per_round: examples per round, every worker together.
    images_per_sec: examples per second.
    ideal_images_per_sec: the ideal heterogeneous aggregate of the cluster at the batch size.
    timeline: the timeline, its ``meta`` complete (:mod:`hetpipe_jax.baselines.timeline`).
  """

  job: SyncJob
  round_seconds: float
  examples_per_round: int
  images_per_sec: float
  ideal_images_per_sec: float
  timeline: dict[str, Any]

  @property
  def efficiency(self) -> float:
    """Images/s over the ideal aggregate."""
    return self.images_per_sec / self.ideal_images_per_sec


def get_system(name: str) -> System:
  """The peer ``name``.

  Raises:
    ConfigError: for an unknown name (listing the known ones).
  """
  if name not in SYSTEMS:
    raise ConfigError(f"unknown system {name!r}; choose one of {', '.join(SYSTEMS)}")
  return SYSTEMS[name]


def simulate_peer(name: str, cluster: Cluster, profiles: BatchProfiles, batch_size: int,
                  knobs: PeerKnobs = DEFAULT_KNOBS, costs: CostContext = DEFAULT_COSTS,
                  model: str = "") -> PeerRun:
  """Builds peer ``name`` on ``cluster`` and simulates it.

  Args:
    name: a key of :data:`SYSTEMS`.
    cluster: the cluster.
    profiles: the model's unit profiles at any batch size.
    batch_size: examples per minibatch (per GPU for data parallelism, per microbatch for pipelines).
    knobs: the system's knobs.
    costs: optimizer slots (memory) and precision.
    model: the model's name, for the timeline.

  Returns:
    The run.

  Raises:
    ConfigError: for an unknown system, bad knobs, or a cluster the system cannot use.
  """
  from hetpipe_jax.plan.costmodel import ideal_images_per_sec  # pylint: disable=g-import-not-at-top
  job = get_system(name).build(cluster, profiles, batch_size, knobs.validate(), costs)
  result = simulate_sync(job)
  ideal = ideal_images_per_sec(cluster, list(profiles.at(batch_size)), batch_size, precision=costs.precision)
  timeline = result.timeline
  timeline["meta"].update(model=model, round_seconds=result.round_seconds,
                          examples_per_round=result.examples_per_round, images_per_sec=result.images_per_sec,
                          ideal_images_per_sec=ideal, efficiency=result.images_per_sec / ideal)
  return PeerRun(job, result.round_seconds, result.examples_per_round, result.images_per_sec, ideal, timeline)
