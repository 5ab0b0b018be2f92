"""Synchronous heterogeneous pipelines in data parallel (Metis, ATC'24; FlashFlex/HexiScale; Sailor,
SOSP'25; AMP, NeurIPS'22).

The partitioner's virtual workers (:func:`hetpipe_jax.plan.allocation.plan_cluster`: pipelines of
different shapes and GPU types, cut by the same exact partitioner as HetPipe's, with the Nm their memory
holds) each train, per iteration, a number of microbatches in proportion to its speed (its planned
throughput), under 1F1B with at most Nm in flight and a flush at the end of the iteration. Each unit's
gradient is all-reduced across the pipelines (among the GPUs that hold it) once every pipeline has
finished its backward of that unit for the iteration, overlapped with the rest of the backward pass, in
fusion buffers (:mod:`hetpipe_jax.baselines.sync`). Synchronous SGD at the global batch (the sum of the
microbatches x the batch size): zero staleness.

What it assumes: the grouping and cuts of HetPipe's planner (so that the comparison isolates WSP; by default
the fastest of its NP, ED and HD groupings), the
iteration's microbatches M over all pipelines (``knobs.microbatches``; default 4 x the most stages of a
pipeline, per pipeline, which keeps the flush's bubble near (k - 1) / (5k - 1)), split by largest
remainders of M x speed share with at least one each; where the GPUs' speeds vary, re-split at every iteration
from the speeds measured in the one before (:mod:`hetpipe_jax.baselines.adapt`).
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.baselines.adapt import Microbatches
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker, simulate_sync
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import parse_policy, plan_cluster
from hetpipe_jax.plan.vw_plan import VWPlan

BEST, POLICIES = "best", ("NP", "ED", "HD")  # knobs.policy="best": the fastest of these


def best_of(policies: tuple[str, ...], build) -> SyncJob:
  """The job of the fastest of ``policies`` (``build(policy) -> SyncJob``; one that cannot run is skipped).

  Raises:
    ConfigError: when none can run (the last one's reason).
  """
  best, error = None, None
  for policy in policies:
    try:
      job = build(policy)
    except ConfigError as e:
      error = e
      continue
    rate = simulate_sync(dataclasses.replace(job, rounds=1)).images_per_sec  # (every round is the same)
    if best is None or rate > best[0]:
      best = (rate, job)
  if best is None:
    raise error or ConfigError("no policy to plan pipelines with")
  return best[1]


def proportional(total: int, weights: list[float]) -> list[int]:
  """``total`` split in proportion to ``weights`` by largest remainders, at least 1 each.

  Raises:
    ConfigError: when ``total`` is smaller than the number of parts.
  """
  if total < len(weights):
    raise ConfigError(f"{total} to split over {len(weights)} workers; give at least one each ({len(weights)})")
  extra = total - len(weights)
  exact = [extra * w / sum(weights) for w in weights]
  parts = [1 + int(x) for x in exact]
  order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
  for i in order[:total - sum(parts)]:
    parts[i] += 1
  return parts


def pipeline_plans(cluster: Cluster, profiles: BatchProfiles, batch_size: int, policy: str,
                   costs: CostContext = DEFAULT_COSTS, tp: int | str = 1):
  """The planner's virtual workers for ``policy`` (see the module docstring) at tensor-parallel degree ``tp``,
  charged the memory of a pipeline that flushes before it updates: every microbatch of a round uses the same
  weights, so no weight version is stashed (``weight_mode="latest"``'s charge; the microbatches' activations
  are)."""
  return plan_cluster(cluster, list(profiles.at(batch_size)), parse_policy(policy), "default", "max_fit", None,
                      costs._replace(weight_mode="latest"), tp).vws


def plan_worker(plan: VWPlan, batch: int, microbatches: int, local_steps: int = 1) -> Worker:
  """A planned virtual worker (:class:`~hetpipe_jax.plan.vw_plan.VWPlan`) as a pipeline worker: its GPUs, cuts,
  Nm in flight and tensor-parallel partners."""
  return Worker(tuple(plan.gpus), tuple(plan.cuts), batch, microbatches, plan.in_flight, local_steps, plan.tp or ())


def sync_pipeline_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                      costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """sync_pipeline on the simulator's network (see the module docstring); ``knobs.policy="best"`` (the
  default) simulates NP, ED and HD and keeps the fastest, as a system that plans its own pipelines would.

  Raises:
    ConfigError: for a policy no partition fits, or fewer microbatches than pipelines.
  """
  if knobs.policy == BEST:
    return best_of(POLICIES, lambda policy: sync_pipeline_job(cluster, profiles, batch_size,
                                                               knobs._replace(policy=policy), costs))
  plans = pipeline_plans(cluster, profiles, batch_size, knobs.policy, costs, knobs.tp)
  total = knobs.microbatches or 4 * max(len(p.stages) for p in plans) * len(plans)
  counts = proportional(total, [p.throughput for p in plans])
  workers = tuple(plan_worker(p, m * batch_size, m) for p, m in zip(plans, counts))
  adapt = Microbatches(total) if knobs.adapting else None
  return SyncJob("sync_pipeline", cluster, workers, profiles, overlap=True, fusion_bytes=knobs.fusion_bytes,
                 cycle_s=knobs.cycle_s, precision=costs.precision, rounds=knobs.sim_rounds, adapt=adapt,
                 knobs=(("batch_size", batch_size), ("policy", knobs.policy), ("microbatches", counts),
                        ("nm", [p.in_flight for p in plans]), ("fusion_mb", knobs.fusion_mb),
                        *((("tp", knobs.tp),) if knobs.tp != 1 else ()),
                        ("gpus", sum(len(w.all_gpus) for w in workers))))
