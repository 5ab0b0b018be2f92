"""TensorFlow's replicated variables, with NCCL or by copies (:mod:`hetpipe_jax.baselines.tf_replicated`)."""

from __future__ import annotations

from hetpipe_jax.baselines.tf_replicated import tf_replicated_copy_job, tf_replicated_job
from hetpipe_jax.systems.peer import Peer


class TFReplicated(Peer):
  name = "tf_replicated"
  summary = "TensorFlow's replicated variables with NCCL: every unit's gradient all-reduced on its own after the " \
            "backward pass"
  build = tf_replicated_job


class TFReplicatedCopy(Peer):
  name = "tf_replicated_copy"
  summary = ("TensorFlow's replicated variables without NCCL: every variable summed on one device by copies after "
             "the backward pass, copied back")
  build = tf_replicated_copy_job
