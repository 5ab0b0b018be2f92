"""Synchronous heterogeneous pipelines: the planner's pipelines, 1F1B with a flush
(:mod:`hetpipe_jax.baselines.sync_pipeline`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync_pipeline import sync_pipeline_job
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.systems.base import DEFAULT_KNOBS, SystemRun
from hetpipe_jax.systems.peer import Peer

MICROBATCH_FACTORS = (1, 2, 4)  # the tuner's grid: microbatches per iteration over the cluster's GPUs


class SyncPipeline(Peer):
  name = "sync_pipeline"
  summary = ("the planner's pipelines, microbatches in proportion to speed, 1F1B with a flush, gradients "
             "all-reduced across pipelines")
  build = sync_pipeline_job

  def grid(self, cluster: Cluster, batch_size: int, policies: Sequence[str]) -> list[PeerKnobs]:
    return [DEFAULT_KNOBS._replace(policy=p, microbatches=m * cluster.num_gpus)
            for p, m in itertools.product(policies, MICROBATCH_FACTORS)]

  def label(self, knobs: PeerKnobs, update_examples: int) -> str:
    return f"sync_pipeline {knobs.policy}, {knobs.microbatches} microbatches (global batch {update_examples})"

  def config(self, run: SystemRun) -> str:
    return f"{run.meta['policy']} pipelines, microbatches {run.meta['microbatches']} of {run.meta['batch_size']}"

