"""Local SGD / DiLoCo (arXiv 2311.08105), with H sized to each worker's speed as asynchronous local SGD
proposes (arXiv 2401.09135).

Every worker, a GPU that holds the whole model (``knobs.local_workers=gpu``, batch ``batch_size`` a step)
or a virtual worker of the planner run as a synchronous pipeline (``vw``: a local step is Nm microbatches
under 1F1B with a flush; the fastest of the NP, ED and HD groupings unless ``knobs.policy`` names one; ``auto``:
GPUs where one holds the model, else virtual workers),
takes H local steps from the global weights, then the workers all-reduce their weight changes (no overlap:
the change is known only after the last step) and an outer optimizer step (Nesterov, outer learning rate
and momentum; ``knobs.outer_lr``, ``knobs.outer_momentum``) updates the global weights. With
``h_by_speed`` each worker's H is in proportion to its speed (the fastest takes ``knobs.local_steps``,
every worker at least 1), so that no worker waits long for the slowest; where the GPUs' speeds vary, every round
re-sizes H from the speeds measured in the round before (:mod:`hetpipe_jax.baselines.adapt`).

What it assumes: the inner optimizer is each worker's own (its state stays local, as DiLoCo's), the
all-reduce is Horovod's (:mod:`hetpipe_jax.baselines.sync`), and the outer step costs nothing in time.
"""

from __future__ import annotations

import dataclasses

from hetpipe_jax.baselines.adapt import LocalSteps
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker
from hetpipe_jax.baselines.sync_pipeline import BEST, POLICIES, best_of, pipeline_plans, plan_worker
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.roofline import model_compute_seconds
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import horovod_gpus


class NoGpuHoldsModel(ConfigError):
  """No GPU of the cluster holds the whole model (local SGD with GPU workers cannot run)."""


def local_sgd_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                  costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """local_sgd on the simulator's network (see the module docstring).

  Raises:
    ConfigError: when no GPU holds the model (gpu workers) or no partition fits (vw workers).
  """
  num_units = len(profiles.low)
  if knobs.local_workers == "auto":
    try:
      return local_sgd_job(cluster, profiles, batch_size, knobs._replace(local_workers="gpu"), costs)
    except NoGpuHoldsModel:
      return local_sgd_job(cluster, profiles, batch_size, knobs._replace(local_workers="vw"), costs)
  if knobs.local_workers == "vw" and knobs.policy == BEST:
    return best_of(POLICIES, lambda policy: local_sgd_job(cluster, profiles, batch_size,
                                                           knobs._replace(policy=policy), costs))
  if knobs.local_workers == "gpu":
    gpus = horovod_gpus(cluster, profiles.at(batch_size), costs)
    if not gpus:
      raise NoGpuHoldsModel("local_sgd: no GPU holds the whole model; use --local_workers=vw (or auto) or "
                            "larger GPUs")
    shapes = [Worker((g,), (0, num_units), batch_size) for g in gpus]
    speeds = [1 / model_compute_seconds(profiles.at(batch_size), g.type, costs.precision) for g in gpus]
  else:
    plans = pipeline_plans(cluster, profiles, batch_size, knobs.policy, costs, knobs.tp)
    shapes = [plan_worker(p, p.in_flight * batch_size, p.in_flight) for p in plans]
    speeds = [p.throughput / p.in_flight for p in plans]  # local steps per second
  fastest = max(speeds)
  hs = [max(1, round(knobs.local_steps * s / fastest)) if knobs.h_by_speed else knobs.local_steps for s in speeds]
  workers = tuple(dataclasses.replace(w, local_steps=h) for w, h in zip(shapes, hs))
  adapt = LocalSteps(knobs.local_steps) if knobs.h_by_speed and knobs.adapting else None
  return SyncJob("local_sgd", cluster, workers, profiles, overlap=False, fusion_bytes=knobs.fusion_bytes,
                 cycle_s=knobs.cycle_s, precision=costs.precision, rounds=knobs.sim_rounds, adapt=adapt,
                 knobs=(("batch_size", batch_size), ("local_workers", knobs.local_workers), ("local_steps", hs),
                        ("outer_lr", knobs.outer_lr), ("outer_momentum", knobs.outer_momentum),
                        ("fusion_mb", knobs.fusion_mb), *((("tp", knobs.tp),) if knobs.tp != 1 else ()),
                        ("gpus", sum(len(w.all_gpus) for w in workers))))
