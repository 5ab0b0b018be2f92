"""Heterogeneity-aware synchronous data parallelism (Cephalo, ICS'25; Poplar, AAAI'25; LB-BSP; HetSeq).

Every GPU that can hold the whole model with one example trains a share of one global batch B, in
proportion to its speed, by as many accumulation steps as its memory needs; one fused all-reduce of the
batch-weighted gradients, overlapped with the backward pass of each GPU's last accumulation step, ends
the step: synchronous SGD at the global batch, no staleness.

The split (:func:`split_batch`) is a small optimisation: integer shares s_g >= 0 with sum B that minimise
the slowest GPU's compute max_g t_g(s_g), where t_g(s) is the roofline time of s examples on g in
ceil(s / m_g) accumulation steps of (nearly) equal size, m_g the most examples g's memory holds at once.
t_g grows with s, so the optimum is found exactly by bisection on the time T (each GPU then takes the most
examples it can finish by T) and trimming the surplus from the GPUs that finish last.

What it assumes: the GPUs' speeds are known (the cost model's; where they vary, the split is re-sized at every
step from measured times as LB-BSP does, :mod:`hetpipe_jax.baselines.adapt`), the all-reduce is Horovod's
(:mod:`hetpipe_jax.baselines.sync`), and the update is the batch-weighted mean of the gradients. With
``knobs.shard_state`` its GPUs may shard the gradient and the optimizer state (ZeRO stage 2: the GPUs that take
part are the fixed point of "those that hold the weights and a 1/N share of the state, N being how many they
are", :func:`sharded_split`; the reduce-scatter and all-gather move the bytes of the all-reduce) or the weights
too (ZeRO stage 3, FSDP, as Cephalo runs it: :func:`fsdp_split`, every micro-step's collectives on the
network); :func:`hetero_dp_job` takes whichever of the three is fastest.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import Rule, SyncJob, Worker, simulate_sync
from hetpipe_jax.cluster import Cluster, Gpu, GpuType
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.roofline import model_compute_seconds
from hetpipe_jax.errors import ConfigError


def max_micro_batch(profiles: BatchProfiles, gpu: GpuType, limit: int, costs: CostContext = DEFAULT_COSTS) -> int:
  """The most examples (<= ``limit``) whose forward and backward fit ``gpu``'s memory with the whole model,
  its gradient and optimizer state (0: not even one)."""
  costs = costs._replace(weight_mode="latest")
  fits = lambda b: stage_memory_bytes(profiles.at(b), 1, costs) <= gpu.memory_bytes
  if not fits(1):
    return 0
  lo, hi = 1, limit  # memory grows with the batch: the largest b that fits, by bisection
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo


class _Speed:
  """t(s): seconds of s examples on one GPU type in accumulation steps of at most ``micro`` examples."""

  def __init__(self, profiles: BatchProfiles, gpu: GpuType, micro: int, precision: str):
    self.profiles, self.gpu, self.micro, self.precision = profiles, gpu, micro, precision
    self._step: dict[int, float] = {}

  def step(self, size: int) -> float:
    if size not in self._step:
      self._step[size] = model_compute_seconds(self.profiles.at(size), self.gpu, self.precision)
    return self._step[size]

  def __call__(self, s: int) -> float:
    if s <= 0:
      return 0.0
    steps = math.ceil(s / self.micro)
    q, r = divmod(s, steps)
    return r * self.step(q + 1) + (steps - r) * (self.step(q) if q else 0.0)


def split_batch(gpus: list[Gpu], profiles: BatchProfiles, global_batch: int,
                costs: CostContext = DEFAULT_COSTS) -> list[tuple[Gpu, int, int]]:
  """The minimax split of ``global_batch`` over ``gpus`` (see the module docstring).

  Returns:
    ``(gpu, share, accumulation steps)`` of every GPU with a share > 0.

  Raises:
    ConfigError: when no GPU holds the model with one example.
  """
  micro = {g.type.name: max_micro_batch(profiles, g.type, global_batch, costs) for g in gpus}
  if not any(micro.values()):
    raise ConfigError("hetero_dp: no GPU holds the whole model with one example; use a cluster with larger GPUs "
                      "or a smaller model")
  return _minimax(gpus, profiles, global_batch, micro, costs.precision, one_pass=False)


def _minimax(gpus: list[Gpu], profiles: BatchProfiles, global_batch: int, micro: dict[str, int], precision: str,
             one_pass: bool, slowness: dict[int, float] | None = None) -> list[tuple[Gpu, int, int]]:
  """:func:`split_batch` with each type's most examples at once ``micro``; ``one_pass``: a GPU takes at most
  that many (no accumulation), and the split is empty where the GPUs together cannot take ``global_batch``;
  ``slowness``: each GPU's (by index) times are its type's times that many times (1 for a GPU not named)."""
  able = [g for g in gpus if micro[g.type.name] > 0]
  if one_pass and sum(min(micro[g.type.name], global_batch) for g in able) < global_batch:
    return []
  slowness = slowness or {}
  speed = {name: _Speed(profiles, next(g.type for g in able if g.type.name == name), m, precision)
           for name, m in micro.items() if m > 0}
  keys = {g.index: (g.type.name, slowness.get(g.index, 1.0)) for g in able}
  times = {(name, k): [speed[name](s) * k if s <= speed[name].micro or not one_pass else math.inf
                       for s in range(global_batch + 1)] for name, k in set(keys.values())}  # nondecreasing in s

  def shares(t: float) -> list[int]:  # the most examples each GPU finishes by t
    return [bisect.bisect_right(times[keys[g.index]], t * (1 + 1e-12)) - 1 for g in able]
  candidates = sorted({x for ts in times.values() for x in ts if x < math.inf})
  lo, hi = 0, len(candidates) - 1
  while lo < hi:  # the smallest time by which the GPUs together finish the global batch
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if sum(shares(candidates[mid])) >= global_batch else (mid + 1, hi)
  share = shares(candidates[lo])
  surplus = sum(share) - global_batch
  while surplus > 0:  # trimmed from whichever GPU finishes last (ties: the last in cluster order)
    g = max(range(len(able)), key=lambda i: (times[keys[able[i].index]][share[i]], i) if share[i] else (-1.0, i))
    share[g] -= 1
    surplus -= 1
  return [(g, s, math.ceil(s / micro[g.type.name])) for g, s in zip(able, share) if s > 0]


def sharded_split(gpus: list[Gpu], profiles: BatchProfiles, global_batch: int,
                  costs: CostContext) -> tuple[CostContext, list[tuple[Gpu, int, int]]]:
  """(``costs`` with the state sharded over N GPUs, :func:`split_batch` under it) where N is the number of GPUs
  that take a share: from N = all of ``gpus``, N shrinks to the GPUs of the split at N until it holds (each
  step's split is among the GPUs that fit at a larger N, so at most len(gpus) steps).

  Raises:
    ConfigError: when no GPU holds the model with one example even with the state sharded over all of them.
  """
  shards = len(gpus)
  while True:
    trial = costs._replace(state_shards=shards)
    split = split_batch(gpus, profiles, global_batch, trial)
    if len(split) == shards:
      return trial, split
    shards = len(split)


def fsdp_split(gpus: list[Gpu], profiles: BatchProfiles, global_batch: int,
               costs: CostContext) -> tuple[CostContext, list[tuple[Gpu, int, int]]]:
  """ZeRO stage 3 as Cephalo runs it (weights, gradient and optimizer state sharded over the N GPUs that take
  part; the same number A of accumulation steps on every GPU, since every micro-step's all-gathers and
  reduce-scatters take every GPU; each GPU's micro-batch sized to its speed and its memory):
  (``costs`` sharded over N, ``(gpu, micro-step share, A)`` of every GPU: the minimax split of one micro-step's
  ``global_batch / A`` examples, each GPU's share taken at once). A is the smallest divisor of ``global_batch``
  whose micro-step the GPUs hold together; N the fixed point of :func:`sharded_split`.

  Raises:
    ConfigError: when no GPU holds one example with the state sharded over all of them.
  """
  for steps in (a for a in range(1, global_batch + 1) if global_batch % a == 0):
    shards, size = len(gpus), global_batch // steps
    while shards:
      trial = costs._replace(state_shards=shards, shard_weights=True)
      micro = {g.type.name: max_micro_batch(profiles, g.type, size, trial) for g in gpus}
      split = _minimax(gpus, profiles, size, micro, costs.precision, one_pass=True)
      if len(split) == shards:
        return trial, [(g, share, steps) for g, share, _ in split]
      shards = len(split)
  raise ConfigError(f"hetero_dp: no GPU holds the model with one example even with its weights, gradient and "
                    f"optimizer state sharded over all {len(gpus)} GPUs; use a cluster with larger GPUs or a "
                    "smaller model")


def hetero_dp_job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs,
                  costs: CostContext = DEFAULT_COSTS) -> SyncJob:
  """hetero_dp on the simulator's network: the global batch (``knobs.global_batch``, default ``batch_size``
  x every GPU of the cluster) split by :func:`split_batch`; with ``knobs.shard_state``, the fastest of that, the
  state sharded (:func:`sharded_split`) and the weights sharded too (:func:`fsdp_split`), as a user of the
  option would run it (ties: the least sharding).

  Raises:
    ConfigError: when no GPU holds the model (sharded: even with everything sharded over every GPU).
  """
  global_batch = knobs.global_batch or batch_size * cluster.num_gpus
  gpus = list(cluster.gpus)
  splits = [lambda: (costs, split_batch(gpus, profiles, global_batch, costs))]
  if knobs.shard_state:
    splits += [lambda: sharded_split(gpus, profiles, global_batch, costs),
               lambda: fsdp_split(gpus, profiles, global_batch, costs)]
  jobs, refused = [], []
  for split in splits:
    try:
      jobs.append(_job(cluster, profiles, batch_size, knobs, *split()))
    except ConfigError as e:
      refused.append(e)
  if not jobs:
    raise refused[-1]  # (sharded: ZeRO-3's, the most sharded)
  if len(jobs) == 1:
    return jobs[0]
  return max(jobs, key=lambda job: simulate_sync(dataclasses.replace(job, rounds=1)).images_per_sec)


def _job(cluster: Cluster, profiles: BatchProfiles, batch_size: int, knobs: PeerKnobs, costs: CostContext,
         split: list[tuple[Gpu, int, int]]) -> SyncJob:
  """The job of a split of the global batch (its state sharded over its GPUs where ``costs`` says so; with the
  weights sharded, each GPU's share is one micro-step's, taken in its accumulation steps, each a local step that
  ends in the collectives: :class:`~hetpipe_jax.baselines.sync.SyncJob`)."""
  fsdp = costs.shard_weights and costs.state_shards > 1
  shares = [s * a if fsdp else s for _, s, a in split]
  num_units = len(profiles.low)
  total = sum(s for _, s, _ in split)  # (sharded weights: a micro-step's examples)
  adapt = Rebalance(profiles, costs.precision, total, fsdp,
                    {g.type.name: max_micro_batch(profiles, g.type, total, costs) for g, _, _ in split}) \
      if knobs.adapting else None
  workers = tuple(Worker((g,), (0, num_units), s, 1, local_steps=a) if fsdp else Worker((g,), (0, num_units), s, a)
                  for g, s, a in split)
  return SyncJob("hetero_dp", cluster, workers, profiles, overlap=True, fusion_bytes=knobs.fusion_bytes,
                 cycle_s=knobs.cycle_s, precision=costs.precision, rounds=knobs.sim_rounds, weights_sharded=fsdp,
                 adapt=adapt,
                 knobs=(("batch_size", batch_size), ("global_batch", sum(shares)), ("fusion_mb", knobs.fusion_mb),
                        ("shares", shares), ("accumulation", [a for _, _, a in split]),
                        *((("state_shards", costs.state_shards),) if costs.state_shards > 1 else ()),
                        *((("shard_weights", True),) if fsdp else ()),
                        ("gpus", len(split))))


@dataclasses.dataclass(frozen=True)
class Rebalance(Rule):
  """LB-BSP's rule on hetero_dp's split (:mod:`hetpipe_jax.baselines.adapt`): each GPU's *slowness* is its busy
  time over what its profile predicts for its share (its type's roofline time, in its accumulation steps), and the
  next step's split is :func:`split_batch`'s minimax with every GPU's times that many times (``total`` examples:
  the global batch, or a micro-step's with sharded weights, ``one_pass``; ``micro``: each type's most at once).
  Every GPU keeps at least one example (it stays in the barrier), taken from the largest share."""

  profiles: BatchProfiles
  precision: str
  total: int
  one_pass: bool
  micro: dict[str, int]
  name = "batch"

  def resize(self, workers: Sequence[Worker], busy: Sequence[float]) -> tuple[Worker, ...]:
    gpus = [w.gpus[0] for w in workers]
    speed = {name: _Speed(self.profiles, next(g.type for g in gpus if g.type.name == name), m, self.precision)
             for name, m in self.micro.items()}
    slowness = {g.index: s / (w.local_steps * speed[g.type.name](w.batch)) for g, w, s in zip(gpus, workers, busy)}
    split = {g.index: (n, a) for g, n, a in _minimax(gpus, self.profiles, self.total, self.micro, self.precision,
                                                     self.one_pass, slowness)}
    shares = [split.get(g.index, (0, 0))[0] for g in gpus]
    for i in [i for i, n in enumerate(shares) if n == 0]:
      shares[max(range(len(shares)), key=lambda k: shares[k])] -= 1
      shares[i] = 1
    return tuple(dataclasses.replace(w, batch=n, microbatches=1 if self.one_pass else -(-n // self.micro[g.type.name]))
                 for g, w, n in zip(gpus, workers, shares))

  def shape(self, workers: Sequence[Worker]) -> dict[str, Any]:
    return {"rule": self.name, "shares": [w.batch for w in workers]}
