"""GPipe: one pipeline over every GPU in order, every forward then every backward
(:mod:`hetpipe_jax.baselines.gpipe`)."""

from __future__ import annotations

from hetpipe_jax.baselines.gpipe import gpipe_job
from hetpipe_jax.systems.peer import Peer


class GPipe(Peer):
  name = "gpipe"
  summary = ("one pipeline over every GPU in order, cuts balanced by compute, every forward then every backward, "
             "checkpointed activations, a flush (GPipe, torchgpipe)")
  build = gpipe_job

