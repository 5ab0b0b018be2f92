"""Heterogeneity-aware data parallelism: per-GPU batches in proportion to speed
(:mod:`hetpipe_jax.baselines.hetero_dp`)."""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.baselines.hetero_dp import hetero_dp_job
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.systems.base import DEFAULT_KNOBS, SystemRun, span
from hetpipe_jax.systems.peer import Peer

GLOBAL_BATCH_FACTORS = (0.5, 1.0, 2.0)  # the tuner's grid: the global batch over batch x GPUs


class HeteroDP(Peer):
  name = "hetero_dp"
  summary = ("per-GPU batch in proportion to speed under each GPU's memory, gradient accumulation, one weighted "
             "fused all-reduce")
  build = hetero_dp_job

  def grid(self, cluster: Cluster, batch_size: int, policies: Sequence[str]) -> list[PeerKnobs]:
    return [DEFAULT_KNOBS._replace(global_batch=max(1, round(f * batch_size * cluster.num_gpus)))
            for f in GLOBAL_BATCH_FACTORS]

  def config(self, run: SystemRun) -> str:
    meta = run.meta
    sharded = ("" if "state_shards" not in meta else
               f", {'weights and ' if meta.get('shard_weights') else ''}state sharded over {meta['state_shards']}")
    return f"global batch {meta['global_batch']}, per GPU {span(meta['shares'])}, accumulation " \
           f"{span(meta['accumulation'])}{sharded}"

