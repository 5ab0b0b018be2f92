"""GPipe (Huang et al., NeurIPS'19; torchgpipe, kakaobrain): one pipeline over every GPU of the cluster, in
the cluster's order, trained synchronously with a flush, on the simulator's network.

A step is a mini-batch of ``knobs.global_batch`` examples (0: ``batch_size`` x the microbatches) in
``knobs.microbatches`` microbatches (torchgpipe's ``chunks``; 0: 4 per GPU, GPipe's m >= 4k), every forward
before the backwards (:data:`hetpipe_jax.core.schedule.SCHEDULES` ``gpipe``), all of them in flight, then the
update. Activations are checkpointed as torchgpipe's default ``except_last``: the backward of every microbatch
but the last runs the stage's forward again first.

The cuts balance the stages' compute (torchgpipe's ``balance_by_time``, which times each layer on its GPU):
the contiguous cut minimising the slowest stage's forward + backward + recomputed forward of one microbatch,
by dynamic programming over the units; the transfers between stages are the simulator's, not part of the cut.

What it assumes: every GPU holds its stage with every microbatch in flight (checkpointing keeps only each
microbatch's stage input, :func:`stage_memory`; the simulation does not refuse a stage that does not fit); one
pipeline, so no all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker
from hetpipe_jax.cluster import Cluster, GpuType
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.memory import memory_bytes, stage_memory_bytes
from hetpipe_jax.cost.roofline import unit_seconds
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError


def balanced_cuts(profiles: Sequence[UnitProfile], types: Sequence[GpuType], precision: str = "fp32"
                  ) -> tuple[int, ...]:
  """The contiguous cut of ``profiles`` over stages on ``types`` (in order) whose slowest stage, forward +
  backward + recomputed forward, is fastest; every stage at least one unit.

  Raises:
    ConfigError: for more stages than units.
  """
  n, k = len(profiles), len(types)
  if not 1 <= k <= n:
    raise ConfigError(f"{k} GPUs for a model of {n} units; give 1 to {n} GPUs to a pipeline")
  cost = [[2 * f + b for f, b in (unit_seconds(u, t, precision) for u in profiles)] for t in types]
  prefix = [[0.0] for _ in types]
  for j in range(k):
    for c in cost[j]:
      prefix[j].append(prefix[j][-1] + c)
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first j stages hold units 0..i-1
  arg = [[0] * (n + 1) for _ in range(k + 1)]
  best[0][0] = 0.0
  for j in range(1, k + 1):
    for i in range(j, n - (k - j) + 1):
      for h in range(j - 1, i):
        value = max(best[j - 1][h], prefix[j - 1][i] - prefix[j - 1][h])
        if value < best[j][i]:
          best[j][i], arg[j][i] = value, h
  cuts, i = [n], n
  for j in range(k, 0, -1):
    i = arg[j][i]
    cuts.append(i)
  return tuple(reversed(cuts))


def stage_memory(profiles: Sequence[UnitProfile], cuts: Sequence[int], microbatches: int, in_bytes: int,
                 costs: CostContext = DEFAULT_COSTS) -> list[int]:
  """Bytes each stage of a GPipe cut holds at its peak, ``profiles`` being at the microbatch's batch: its
  weights and state (one version, ``costs.weight_mode`` aside), the stage input of every microbatch but one
  (torchgpipe's ``except_last`` checkpointing), and one microbatch's activations (the last one's, kept; then
  each recomputed one's while its backward runs), charged as ``costs.activations`` says; ``in_bytes`` is the
  first stage's input of one microbatch.
  """
  latest = costs._replace(weight_mode="latest")
  return [stage_memory_bytes(profiles[a:b], 1, latest)
          + int(memory_bytes(0, (microbatches - 1) * (in_bytes if a == 0 else profiles[a - 1].out_bytes), 1, latest))
          for a, b in zip(cuts[:-1], cuts[1:])]


def gpipe_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
              costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """GPipe on ``cluster`` (see the module docstring).

  Raises:
    ConfigError: for a mini-batch smaller than its microbatches, or more GPUs than units.
  """
  gpus = tuple(cluster.gpus)
  m = knobs.microbatches or 4 * len(gpus)
  batch = knobs.global_batch or batch_size * m
  if batch < m:
    raise ConfigError(f"gpipe: a mini-batch of {batch} in {m} microbatches; give global_batch >= microbatches")
  cuts = balanced_cuts(profiles.at(batch // m), [g.type for g in gpus], costs.precision)
  worker = Worker(gpus, cuts, batch, microbatches=m, nm=m)
  return SyncJob("gpipe", cluster, (worker,), profiles, overlap=True, fusion_bytes=0.0, cycle_s=0.0,
                 precision=costs.precision, rounds=knobs.sim_rounds, schedule="gpipe", recompute=True,
                 knobs=(("global_batch", batch), ("microbatches", m), ("cuts", list(cuts)), ("gpus", len(gpus))))
