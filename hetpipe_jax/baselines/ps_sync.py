"""TensorFlow's synchronous parameter server (``tf_cnn_benchmarks --variable_update=parameter_server``, the
2017 TensorFlow benchmarks' distributed runs), on the simulator's network.

Every GPU that holds the model trains ``batch_size`` examples a step, as :mod:`hetpipe_jax.baselines.horovod`.
The variables live on parameter-server tasks, one on each worker host (its CPU), each unit's variables on one
task, the units dealt round-robin over the tasks (TensorFlow's ``replica_device_setter`` places variables
round-robin; one large variable stays on one task). As the backward pass finishes a unit on every worker,
every worker pushes that unit's gradient to its task (a flow over the host's PCIe when the task is local, else
over the network, no fusion); once every unit is pushed by every worker (synchronous replicas: the task
applies the mean), every worker pulls every variable back, each task's share in one transfer; the step ends
when every pull has landed (:func:`hetpipe_jax.baselines.sync.SyncJob` ``exchange="ps"``).

What it assumes: the update on the PS costs no time; pulls do not overlap the next step's forward pass
(TensorFlow reads a variable when an op needs it, so part of a real pull overlaps; the model is slower there);
every worker finishes a unit at the same time (true of the equal GPUs of the published runs).

``ps_replicated`` (``--variable_update=distributed_replicated``, TensorFlow's 2017 distributed runs): the same
with each host's GPUs as one worker: a unit's gradient is summed inside the host first and the host pushes
one copy, pulls one copy and copies it to its other GPUs (``exchange="ps_host"``).
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, equal_batch_job
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext


def ps_sync_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """The synchronous parameter server on ``cluster``, every GPU a worker (see the module docstring).

  Raises:
    ConfigError: when no GPU holds the model.
  """
  return _ps("ps_sync", "ps", cluster, profiles, batch_size, knobs, costs)


def ps_replicated_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                      costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """The synchronous parameter server on ``cluster``, every host a worker (see the module docstring).

  Raises:
    ConfigError: when no GPU holds the model.
  """
  return _ps("ps_replicated", "ps_host", cluster, profiles, batch_size, knobs, costs)


def _ps(system: str, exchange: str, cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
        costs: CostContext) -> SyncJob:
  job = equal_batch_job(system, cluster, profiles, batch_size, knobs.sim_rounds, costs, overlap=True, fusion_bytes=0.0,
                        cycle_s=0.0, exchange=exchange)
  hosts = len({g.node for w in job.workers for g in w.gpus})
  return dataclasses.replace(job, knobs=(*job.knobs[:1], ("ps_tasks", hosts), *job.knobs[1:]))
