"""TensorFlow's replicated variables in one process (``tf_cnn_benchmarks --variable_update=replicated``, the
mode of Lambda's published benchmarks and of TensorFlow's 2017 single-server runs), on the simulator's network.

Every GPU that holds the model keeps a copy of the variables and trains ``batch_size`` examples a step, as
:mod:`hetpipe_jax.baselines.horovod`. The gradients meet after the backward pass (``preprocess_device_grads``
takes every tower's gradient list at once, ``batch_allreduce.py``), every variable on its own
(``--gradient_repacking=0``, the default: no fusion):

* ``tf_replicated`` (``--all_reduce_spec=nccl``): each unit's gradient is one NCCL ring all-reduce
  (:mod:`hetpipe_jax.baselines.collective`), one after another;
* ``tf_replicated_copy`` (no all-reduce spec, "replicated (without NCCL)"): each variable is summed on one
  device by copies and the sum copied back to every tower (``aggregate_gradients_using_copy_with_device_
  selection``): the ``ps`` exchange of :mod:`hetpipe_jax.baselines.sync` with the tasks on the one host.

What it assumes: the all-reduce does not overlap the backward pass. The measurements decide that, not the
source: an overlapped all-reduce puts Lambda's 8 x RTX 2080 Ti VGG-16 at 1,518 images/s against 961
published, an exposed one at 5.7 GB/s predicts its step within 1% (BUILD_NOTES.md, issue 24).
"""

from __future__ import annotations

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, equal_batch_job
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext


def _replicated(system: str, exchange: str, cluster: Cluster, profiles: BatchProfiles, batch_size: int,
                knobs: PeerKnobs, costs: CostContext) -> SyncJob:
  return equal_batch_job(system, cluster, profiles, batch_size, knobs.sim_rounds, costs, overlap=False,
                         fusion_bytes=0.0, cycle_s=0.0, exchange=exchange)


def tf_replicated_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                      costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """Replicated variables with NCCL (see the module docstring).

  Raises:
    ConfigError: when no GPU holds the model.
  """
  return _replicated("tf_replicated", "allreduce", cluster, profiles, batch_size, knobs, costs)


def tf_replicated_copy_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                           costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """Replicated variables summed by copies (see the module docstring).

  Raises:
    ConfigError: when no GPU holds the model.
  """
  return _replicated("tf_replicated_copy", "ps", cluster, profiles, batch_size, knobs, costs)
