"""Horovod: equal batches on every GPU that holds the model (:mod:`hetpipe_jax.baselines.horovod`)."""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.baselines.horovod import horovod_job
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.systems.base import DEFAULT_KNOBS, SystemRun
from hetpipe_jax.systems.peer import Peer

FUSION_MB = (64.0, 0.0)  # the tuner's grid: Horovod's default buffer, and every tensor alone as a check


class Horovod(Peer):
  name = "horovod"
  summary = "equal batches on every GPU that holds the model, fused ring all-reduce overlapped with the backward pass"
  build = horovod_job

  def grid(self, cluster: Cluster, batch_size: int, policies: Sequence[str]) -> list[PeerKnobs]:
    return [DEFAULT_KNOBS._replace(fusion_mb=f) for f in FUSION_MB]

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    return f"horovod, fusion {knobs.fusion_mb:g} MiB"

  def config(self, run: SystemRun) -> str:
    return f"batch {run.meta['batch_size']} per GPU, fusion {run.meta['fusion_mb']:g} MiB"

