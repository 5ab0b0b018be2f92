"""The knobs of the peers (:mod:`hetpipe_jax.baselines`): one record, each system reads its own.

``experiments.peer_flags`` declares them as flags once, from this record's defaults (``experiments.baseline``
and the studies read them); the tuner searches them (each system's grid: batch split, microbatches per
pipeline, H, ...).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hetpipe_jax.baselines.sync import CYCLE_S, FUSION_BYTES
from hetpipe_jax.core.controls import DEFAULT as DEFAULT_CONTROL
from hetpipe_jax.core.controls import Control, parse_control
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.partition import NM_POLICIES
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.sim.noise import parse_noise
from hetpipe_jax.sim.options import ADAPT

WORKER_KINDS = ("auto", "gpu", "vw")
QUIET_ROUNDS = 2  # rounds simulated without noise (every round is the same; two show it)
NOISY_ROUNDS = 16  # rounds simulated under noise (the adaptation's first re-sizing and fifteen rounds after it)


class PeerKnobs(NamedTuple):
  """Attributes:
    fusion_mb: the fusion buffer in MiB (Horovod's default 64; 0: no fusion).
    cycle_ms: how often ready tensors are collected (Horovod's default 1 ms).
    global_batch: hetero_dp's examples per step over every GPU (0: the batch size x the GPUs that train);
      gpipe's mini-batch (0: the batch size x its microbatches).
    microbatches: gpipe's microbatches per step (0: 4 per GPU); sync_pipeline's microbatches per iteration over
      every pipeline, split in proportion to each
      pipeline's speed (0: 4 x the most stages of a pipeline, per pipeline).
    policy: how GPUs are grouped into pipelines (sync_pipeline, local_sgd with vw workers): NP, ED, HD, a
      grouping, or ``best`` (the fastest of NP, ED and HD).
    local_steps: local_sgd's H, the local steps between synchronisations (of the fastest worker with
      ``h_by_speed``).
    h_by_speed: local_sgd: each worker's H in proportion to its speed (the fastest takes ``local_steps``).
    local_workers: local_sgd's workers: ``gpu`` (every GPU that holds the model), ``vw`` (pipelines), or
      ``auto`` (GPUs where any GPU holds the model, else pipelines: what DiLoCo's authors do with a model that
      no one GPU holds).
    outer_lr / outer_momentum: local_sgd's outer Nesterov step (DiLoCo: 0.7 and 0.9); no effect on time.
    rounds: rounds simulated (0: :data:`QUIET_ROUNDS` without noise, where every round is the same,
      :data:`NOISY_ROUNDS` under it).
    nm_rule: hetpipe's Nm rule (:data:`~hetpipe_jax.plan.partition.NM_POLICIES`): ``max_fit`` (the largest Nm
      that fits), ``best`` (the modelled fastest), ``speed`` (waves sized to each virtual worker's speed).
    tp: the tensor-parallel degree of a system's pipeline stages (sync_pipeline, local_sgd with vw workers,
      hetpipe), as HetPipe's planner splits them (:mod:`hetpipe_jax.plan.tensor_groups`; "auto": its fastest
      degree): Megatron-LM's split inside a node, which pipeline systems on large models run (Metis, FlashFlex).
      Data-parallel workers of one GPU (horovod, hetero_dp, local_sgd's gpu workers) do not split.
    shard_state: hetero_dp: its GPUs may shard the gradient and the optimizer state among them (ZeRO stage 2, as
      Poplar runs heterogeneous data parallelism; :func:`hetpipe_jax.cost.memory.param_copies`; the same traffic
      as the all-reduce) or the weights too (ZeRO stage 3, FSDP, as Cephalo runs it: 1.5x the traffic, every
      micro-step), whichever is fastest, so a GPU too small for the replicated state takes part.
    noise: the GPUs' variance on the simulator, every system alike (:mod:`hetpipe_jax.sim.noise`; "none": each
      task at the cost model's time).
    adapt: whether the peers re-size their workers' work at every barrier from measured times, as their authors
      do (:mod:`hetpipe_jax.baselines.adapt`): ``on``, ``off``, or ``auto`` (where the GPUs vary, under
      ``noise``: without it the simulated GPUs run at the cost model's speeds, from which the peers were sized).
    staleness: hetpipe's staleness control inside a virtual worker (:mod:`hetpipe_jax.core.controls`): its memory
      charge decides the Nm that fits, and its training runs under it.
  """

  fusion_mb: float = FUSION_BYTES / (1 << 20)
  cycle_ms: float = CYCLE_S * 1e3
  global_batch: int = 0
  microbatches: int = 0
  policy: str = "best"
  local_steps: int = 8
  h_by_speed: bool = False
  local_workers: str = "auto"
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  rounds: int = 0
  nm_rule: str = "max_fit"
  tp: int | str = 1
  shard_state: bool = False
  noise: str = "none"
  adapt: str = "auto"
  staleness: str = DEFAULT_CONTROL

  @property
  def fusion_bytes(self) -> float:
    return self.fusion_mb * (1 << 20)

  @property
  def cycle_s(self) -> float:
    return self.cycle_ms / 1e3

  @property
  def sim_rounds(self) -> int:
    """Rounds to simulate (``rounds``, or its automatic value)."""
    return self.rounds or (QUIET_ROUNDS if parse_noise(self.noise).quiet else NOISY_ROUNDS)

  @property
  def control(self) -> Control:
    """HetPipe's parsed staleness control (:mod:`hetpipe_jax.core.controls`)."""
    return parse_control(self.staleness)

  @property
  def adapting(self) -> bool:
    """Whether the peers adapt (``adapt``, ``auto`` resolved)."""
    return self.adapt == "on" or (self.adapt == "auto" and not parse_noise(self.noise).quiet)

  def validate(self) -> PeerKnobs:
    """Itself, once every knob is in range.

    Raises:
      ConfigError: naming the first knob out of range, its limit and what to give.
    """
    checks = [("fusion_mb", self.fusion_mb, math.isfinite(self.fusion_mb) and self.fusion_mb >= 0, ">= 0 MiB"),
              ("cycle_ms", self.cycle_ms, math.isfinite(self.cycle_ms) and self.cycle_ms >= 0, ">= 0 ms"),
              ("global_batch", self.global_batch, self.global_batch >= 0, ">= 0 (0: automatic)"),
              ("microbatches", self.microbatches, self.microbatches >= 0, ">= 0 (0: automatic)"),
              ("local_steps", self.local_steps, self.local_steps >= 1, ">= 1"),
              ("local_workers", self.local_workers, self.local_workers in WORKER_KINDS, "auto, gpu or vw"),
              ("outer_lr", self.outer_lr, math.isfinite(self.outer_lr) and self.outer_lr > 0, "> 0"),
              ("outer_momentum", self.outer_momentum, 0 <= self.outer_momentum < 1, "in [0, 1)"),
              ("rounds", self.rounds, self.rounds >= 0, ">= 0 (0: automatic)"),
              ("adapt", self.adapt, self.adapt in ADAPT, ", ".join(ADAPT)),
              ("nm_rule", self.nm_rule, self.nm_rule in NM_POLICIES, f"one of {', '.join(NM_POLICIES)}")]
    for name, value, ok, limit in checks:
      if not ok:
        raise ConfigError(f"--{name}={value}; give {limit}")
    parse_tp(self.tp)
    parse_noise(self.noise)
    parse_control(self.staleness)
    return self
