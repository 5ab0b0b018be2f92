"""TensorFlow's synchronous parameter server, per GPU or per host (:mod:`hetpipe_jax.baselines.ps_sync`)."""

from __future__ import annotations

from hetpipe_jax.baselines.ps_sync import ps_replicated_job, ps_sync_job
from hetpipe_jax.systems.peer import Peer


class PSSync(Peer):
  name = "ps_sync"
  summary = ("TensorFlow's synchronous parameter server: variables round-robin over one PS task per worker host, "
             "every worker pushes every gradient and pulls every variable a step")
  build = ps_sync_job


class PSReplicated(Peer):
  name = "ps_replicated"
  summary = ("ps_sync with each host's GPUs as one worker: gradients summed inside the host, one push and one "
             "pull per host (distributed_replicated)")
  build = ps_replicated_job
