"""Synchronous training on the simulator's network: the engine of every peer of :mod:`hetpipe_jax.baselines`.

A *worker* is a pipeline of one or more GPUs (one GPU: a data-parallel worker) that trains one model
replica. A *round* is what happens between two synchronisations:

1. every worker takes its ``local_steps`` local steps; a local step is its ``batch`` examples in
   ``microbatches`` microbatches through its pipeline under its schedule (1F1B, or GPipe's) with at most
   ``nm`` in flight, and a flush
   (the step ends when its last backward is done; one GPU: gradient accumulation over its microbatches).
   A task's input (the previous stage's activation, the next stage's gradient) is a flow over the links
   between the two GPUs that leaves when it is produced and travels while the receiving GPU computes
   (asynchronous point-to-point, as every pipeline system sends it);
2. the gradients (or, after several local steps, the weight changes) are all-reduced: the GPUs that hold
   a unit in every worker form that unit's communicator (every GPU for data parallelism; the GPUs of one
   stage position for pipelines cut alike), and each communicator reduces its units as Horovod does
   (tensor fusion): every ``cycle_s`` the tensors that every member has finished are packed, in the
   order they became ready, into buffers of up to ``fusion_bytes`` and all-reduced one buffer after
   another (:func:`hetpipe_jax.baselines.collective.allreduce`, flows on the shared links). With
   ``overlap`` a unit's gradient is ready when its backward of the last microbatch of the round is done on
   every worker (the all-reduce overlaps the rest of the backward pass); without it, when the worker's
   last local step is done;
3. the round ends when every all-reduce is done; the update (local optimizer or outer step) is applied at
   once and the next round starts on every worker at that moment (a synchronous barrier).

Compute times are the roofline's (:func:`hetpipe_jax.cost.roofline.unit_seconds`, the calibrated
catalogue) at each microbatch's size (:class:`hetpipe_jax.cost.batch.BatchProfiles`), the links
and their sharing those of the ``sim`` executor (:class:`hetpipe_jax.sim.network.Simulator`). In mixed
precision the gradients and activations travel in 16 bits.

The run writes a *timeline* (:mod:`hetpipe_jax.baselines.timeline`): per GPU, every interval as compute,
link (waiting for an input in flight), bubble (other idle time inside a local step), allreduce (done,
waiting for an all-reduce it takes part in), sync (done, waiting for slower workers) or unused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from hetpipe_jax.baselines.collective import allreduce
from hetpipe_jax.baselines.timeline import Log, build_timeline
from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.core import schedule as sched
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.roofline import unit_seconds
from hetpipe_jax.cost.transfer import split_allreduce_seconds, stage_allreduce_flows
from hetpipe_jax.errors import ConfigError, ProtocolError
from hetpipe_jax.plan.allocation import horovod_gpus
from hetpipe_jax.precision import byte_scale
from hetpipe_jax.sim.network import Simulator
from hetpipe_jax.sim.noise import Realisation

FUSION_BYTES = 64 << 20  # Horovod's default fusion buffer (HOROVOD_FUSION_THRESHOLD, docs/tensor-fusion.rst)
CYCLE_S = 1e-3  # Horovod's default cycle time (HOROVOD_CYCLE_TIME, 1 ms since Horovod 0.21; 5 ms before)
EXCHANGES = ("allreduce", "ps", "ps_host")
FSDP_BYTES = 1.5  # a ZeRO-3 micro-step's collectives over a ring all-reduce's (two all-gathers, a reduce-scatter)


@dataclasses.dataclass(frozen=True)
class Worker:
  """One model replica: its GPUs (one per stage), its cuts, and what it trains per round.

  Attributes:
    gpus: the GPU of each stage.
    cuts: stage j holds units ``cuts[j] .. cuts[j + 1] - 1`` (``(0, num_units)`` for one GPU).
    batch: examples per local step.
    microbatches: microbatches per local step (as equal as can be: the first ``batch % microbatches`` one
      example larger).
    nm: most microbatches in flight (its memory's limit; 1 for one GPU).
    local_steps: local steps per round (1: synchronous SGD).
    tp: each stage's tensor-parallel partner GPUs (empty: one GPU per stage), as HetPipe's planner gives them
      (:mod:`hetpipe_jax.plan.tensor_groups`): a split stage's units are charged their share and their
      all-reduces on the node's link (:func:`hetpipe_jax.cost.transfer.split_allreduce_seconds`), its GPUs work
      alike (the partners' timelines repeat the stage's), and its gradient's ring between workers runs over the
      stages' own GPUs with the whole gradient (the t shards' rings cross the nodes' links together).
  """

  gpus: tuple[Gpu, ...]
  cuts: tuple[int, ...]
  batch: int
  microbatches: int = 1
  nm: int = 1
  local_steps: int = 1
  tp: tuple[tuple[Gpu, ...], ...] = ()

  def stage_gpus(self, j: int) -> tuple[Gpu, ...]:
    """Stage ``j``'s GPUs: its own, then its tensor-parallel partners."""
    return (self.gpus[j], *(self.tp[j] if self.tp else ()))

  @property
  def all_gpus(self) -> list[Gpu]:
    """Every GPU the worker trains on, partners included."""
    return [g for j in range(len(self.gpus)) for g in self.stage_gpus(j)]

  def micro_size(self, mb: int) -> int:
    """Examples of microbatch ``mb`` (1-based) of a local step."""
    q, r = divmod(self.batch, self.microbatches)
    return q + 1 if mb <= r else q

  @property
  def examples_per_round(self) -> int:
    """Examples of one round."""
    return self.batch * self.local_steps


class Rule:
  """How a peer re-sizes its workers at a barrier from measured times (:mod:`hetpipe_jax.baselines.adapt`)."""

  name = ""

  def resize(self, workers: Sequence[Worker], busy: Sequence[float]) -> tuple[Worker, ...]:
    """The next round's workers, from this round's and their busy seconds."""
    raise NotImplementedError

  def shape(self, workers: Sequence[Worker]) -> dict[str, Any]:
    """What the rule sizes, of ``workers`` (a timeline's ``adapted``)."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SyncJob:
  """A synchronous system on a cluster.

  Attributes:
    system: its name (``horovod``, ``hetero_dp``, ``sync_pipeline``, ``local_sgd``).
    cluster: the cluster.
    workers: the model replicas.
    profiles: the model's unit profiles at any batch size.
    overlap: all-reduce each unit's gradient once it is ready (else after the last local step).
    fusion_bytes: the fusion buffer (0: every tensor on its own).
    cycle_s: how often ready tensors are collected.
    precision: "fp32", "fp16" or "bf16".
    rounds: rounds simulated (every round is the same; two show it).
    knobs: what the system was built with (its JSON).
    exchange: how gradients meet: ``allreduce`` (ring, fused), or ``ps`` (a synchronous parameter server,
      :mod:`hetpipe_jax.baselines.ps_sync`: every unit's variables on one PS task, the tasks round-robin over
      the workers' hosts; each worker pushes a unit's gradient to its task when ready, and once every unit is
      pushed by every worker, pulls every variable back), or ``ps_host`` (the same with the GPUs of a host
      as one worker, :func:`hetpipe_jax.baselines.ps_sync.ps_replicated_job`: a unit's gradients are first
      summed inside each host, one flow of (g - 1) x its bytes over the host's PCIe for g GPUs, then the host
      pushes one copy; the pull reads one copy per host and copies it to the host's other GPUs).
    schedule: the pipelines' schedule (:data:`hetpipe_jax.core.schedule.SCHEDULES`): ``1f1b``, or ``gpipe``
      (every forward of the step before its backwards).
    recompute: activation checkpointing as torchgpipe's ``except_last``: the backward of every microbatch but
      a step's last runs its stage's forward again first.
    weights_sharded: the workers shard the weights too (ZeRO stage 3, FSDP; workers of one GPU, each local step
      a micro-step of gradient accumulation, the same number on every worker): every local step ends in the
      collectives of every unit and a barrier (each unit's weights all-gathered for its forward and again for
      its backward, its gradient reduce-scattered: 3 x (N - 1) / N of its bytes per GPU, 1.5 x a ring
      all-reduce's, :data:`FSDP_BYTES`), and the next starts when they are done. The simulator overlaps all
      three with the backward pass (FSDP overlaps the forward's all-gathers with the forward by prefetching
      them): the same bytes on the same links, the same barrier, the exposed part placed at the step's end.
    adapt: how the workers are re-sized at every barrier from the round's measured times
      (:mod:`hetpipe_jax.baselines.adapt`; None: as built, every round).
  """

  system: str
  cluster: Cluster
  workers: tuple[Worker, ...]
  profiles: BatchProfiles
  overlap: bool = True
  fusion_bytes: float = FUSION_BYTES
  cycle_s: float = CYCLE_S
  precision: str = "fp32"
  rounds: int = 2
  knobs: tuple[tuple[str, Any], ...] = ()
  exchange: str = "allreduce"
  schedule: str = "1f1b"
  recompute: bool = False
  weights_sharded: bool = False
  adapt: Rule | None = None

  def __post_init__(self):
    if not self.workers:
      raise ConfigError(f"{self.system}: no worker; give a cluster with a GPU that can train the model, or let it "
                        "keep less (recompute=selective, full or auto; activations=eager, as PyTorch keeps them)")
    num_units = len(self.profiles.low)
    for i, w in enumerate(self.workers):
      if len(w.cuts) != len(w.gpus) + 1 or w.cuts[0] != 0 or w.cuts[-1] != num_units or \
          any(a >= b for a, b in zip(w.cuts, w.cuts[1:])):
        raise ConfigError(f"{self.system} worker {i}: cuts {list(w.cuts)} for {len(w.gpus)} GPUs; give increasing "
                          f"cuts from 0 to {num_units} with one stage per GPU")
      if min(w.microbatches, w.nm, w.local_steps) < 1 or w.batch < w.microbatches:
        raise ConfigError(f"{self.system} worker {i}: batch={w.batch}, microbatches={w.microbatches}, nm={w.nm}, "
                          f"local_steps={w.local_steps}; each must be >= 1, and batch >= microbatches")
    used = [g.index for w in self.workers for g in w.all_gpus]
    if len(used) != len(set(used)):
      raise ConfigError(f"{self.system}: a GPU is in two workers; give each GPU to one worker")
    if self.schedule not in sched.SCHEDULES:
      raise ConfigError(f"{self.system}: schedule={self.schedule!r}; give one of {', '.join(sched.SCHEDULES)}")
    if self.exchange not in EXCHANGES:
      raise ConfigError(f"{self.system}: exchange={self.exchange!r}; give one of {', '.join(EXCHANGES)}")
    if self.weights_sharded and (self.exchange != "allreduce" or len({w.local_steps for w in self.workers}) > 1 or
                                 any(len(w.all_gpus) > 1 for w in self.workers)):
      raise ConfigError(f"{self.system}: weights_sharded with exchange={self.exchange!r} and workers of "
                        f"{sorted({len(w.all_gpus) for w in self.workers})} GPUs, "
                        f"{sorted({w.local_steps for w in self.workers})} local steps; sharded weights take "
                        "workers of one GPU, the same local steps (micro-steps) on each, and the all-reduce")
    if self.rounds < 1 or not self.cycle_s >= 0 or not self.fusion_bytes >= 0:
      raise ConfigError(f"{self.system}: rounds={self.rounds}, cycle_s={self.cycle_s}, "
                        f"fusion_bytes={self.fusion_bytes}; give rounds >= 1 and cycle_s, fusion_bytes >= 0")


def equal_batch_job(system: str, cluster: Cluster, profiles: BatchProfiles, batch_size: int, rounds: int,
                    costs: CostContext, knobs: tuple[tuple[str, Any], ...] = (), **options: Any) -> SyncJob:
  """Data parallelism with equal batches: every GPU that holds the whole model at ``batch_size``
  (:func:`hetpipe_jax.plan.allocation.horovod_gpus`, under ``costs``) is a worker of one GPU; ``options`` are
  :class:`SyncJob`'s (overlap, fusion, exchange); its knobs are the batch, ``knobs`` and the GPUs.

  Raises:
    ConfigError: when no GPU holds the model.
  """
  gpus = horovod_gpus(cluster, profiles.at(batch_size), costs)
  num_units = len(profiles.low)
  return SyncJob(system, cluster, tuple(Worker((g,), (0, num_units), batch_size) for g in gpus), profiles,
                 precision=costs.precision, rounds=rounds,
                 knobs=(("batch_size", batch_size), *knobs, ("gpus", len(gpus))), **options)


class SyncResult(NamedTuple):
  """What a simulated synchronous run gives.

  Attributes:
    round_seconds: seconds of one round (the mean over the simulated rounds; where the adaptation changes the
      examples of a round, the seconds of the last round's examples at the run's mean rate).
    examples_per_round: examples every worker together trains per round (the last round's).
    images_per_sec: examples per second over the run.
    timeline: the run's timeline (:mod:`hetpipe_jax.baselines.timeline`).
    workers: the last round's workers (the job's, or as its adaptation re-sized them).
  """

  round_seconds: float
  examples_per_round: int
  images_per_sec: float
  timeline: dict[str, Any]
  workers: tuple[Worker, ...]


class _Comm:
  """A communicator: the GPUs that hold the same units in every worker, and those units' tensors."""

  def __init__(self, gpus: tuple[Gpu, ...], units: list[int]):
    self.gpus, self.units = gpus, units
    self.waiting: dict[int, int] = {}  # unit -> workers that have not finished it this round
    self.ready: list[int] = []  # units every member finished, negotiated, not yet reduced
    self.left = 0  # units not yet reduced this round
    self.busy = False
    self.intervals: list[tuple[float, float]] = []


def simulate_sync(job: SyncJob, noise: Realisation | None = None) -> SyncResult:
  """Simulates ``job`` for ``job.rounds`` rounds (see the module docstring); with ``noise``, each task's seconds
  times its draw of the GPUs' variance at its start (:meth:`hetpipe_jax.sim.noise.Realisation.task_factor`).

  Raises:
    ProtocolError: when the run stalls (a bug).
  """
  run = _Run(job, noise)
  seconds = run.go()
  timeline = build_timeline(job, run.log)
  if job.adapt is not None:
    timeline["meta"]["adapted"] = job.adapt.shape(run.workers)
  examples = sum(w.examples_per_round for w in run.workers)  # (a round of the last shape, at the mean rate)
  return SyncResult(seconds / job.rounds * examples / (run.examples / job.rounds), examples, run.examples / seconds,
                    timeline, run.workers)


class _Run:
  """One simulation: the simulator, each worker's pipeline state, the communicators."""

  def __init__(self, job: SyncJob, noise: Realisation | None = None):
    self.job, self.sim, self.noise = job, Simulator(job.cluster, noise=noise), noise  # (its links vary too)
    self.workers = job.workers  # (re-sized at every barrier where the job adapts)
    self.busy = [0.0] * len(job.workers)  # each worker's busy seconds of the round (the adaptation's measure)
    self.examples = 0  # examples of the rounds done
    self.log = Log()
    self.scale = byte_scale(job.precision)
    self._costs: dict[tuple[int, int, int], tuple] = {}  # (worker, stage, examples) -> :meth:`_cost`
    factor = self.scale * (FSDP_BYTES if job.weights_sharded else 1)
    self.tensor_bytes = {u: p.param_bytes * factor for u, p in enumerate(job.profiles.low) if p.param_bytes}
    self.comms = self._communicators()
    self.comm_of = {u: c for c in self.comms for u in c.units}
    self.states = [sched.init(len(w.gpus), i) for i, w in enumerate(job.workers)]  # (each step starts anew)
    self.steps = [0] * len(job.workers)
    self.arrived: list[set] = [set() for _ in job.workers]
    self.workers_left = 0
    self.round_start = 0.0
    self.rounds_done = 0
    hosts = sorted({g.node for w in job.workers for g in w.gpus})
    self.ps_host = {u: hosts[k % len(hosts)] for k, u in enumerate(self.tensor_bytes)}  # round-robin
    self.pulls_left = 0

  def _cost(self, i: int, j: int, size: int) -> tuple[float, float, list[tuple[int, float]], float, tuple]:
    """Stage ``j`` of worker ``i`` on a microbatch of ``size`` examples: (forward s, backward s, each unit's
    backward s in reverse order, the bytes of its output activation, and a split stage's all-reduces as the
    network carries them: ((forward compute s, bytes), (backward compute s, bytes)) on its node's link, the
    compute with the all-reduces' latencies but the flow's own; () on one GPU)."""
    found = self._costs.get((i, j, size))
    if found is None:
      w = self.workers[i]
      profiles, degree = self.job.profiles.at(size), len(w.stage_gpus(j))
      units = range(w.cuts[j], w.cuts[j + 1])
      split = [profiles[u].split(degree) for u in units]
      computes = [unit_seconds(p, w.gpus[j].type, self.job.precision) for p in split]
      times = [tuple(c + r for c, r in zip(compute, split_allreduce_seconds(self.job.cluster, p, self.job.precision)))
               for p, compute in zip(split, computes)]
      flows = stage_allreduce_flows(self.job.cluster, split, self.job.precision)
      latency = self.job.cluster.intra_node.latency_s
      found = self._costs[(i, j, size)] = (
          sum(t[0] for t in times), sum(t[1] for t in times),
          [(u, t[1]) for u, t in zip(reversed(units), reversed(times))],
          profiles[w.cuts[j + 1] - 1].out_bytes * self.scale,
          () if not flows[0][0] + flows[1][0] else
          tuple((sum(c[k] for c in computes) + lat - latency, num_bytes) for k, (num_bytes, lat) in enumerate(flows)))
    return found

  def _communicators(self) -> list[_Comm]:
    profiles = self.job.profiles.low
    by_members: dict[tuple[int, ...], list[int]] = {}
    gpu_of: dict[int, Gpu] = {}
    for u in range(len(profiles) - 1, -1, -1):  # backward order
      if not profiles[u].param_bytes:
        continue
      members = []
      for w in self.workers:
        j = next(j for j in range(len(w.gpus)) if w.cuts[j] <= u < w.cuts[j + 1])
        members.append(w.gpus[j].index)
        gpu_of[w.gpus[j].index] = w.gpus[j]
      by_members.setdefault(tuple(sorted(members)), []).append(u)
    return [_Comm(tuple(gpu_of[i] for i in m), units) for m, units in by_members.items()]

  def go(self) -> float:
    self._start_round(0.0)
    end = self.sim.drain()
    if self.rounds_done != self.job.rounds:
      raise ProtocolError(f"{self.job.system}: the simulation stalled in round {self.rounds_done + 1}")
    return end

  # rounds and local steps

  def _start_round(self, t: float) -> None:
    self.steps = [0] * len(self.workers)
    self.busy = [0.0] * len(self.workers)
    self._start_sync(t)

  def _start_sync(self, t: float) -> None:
    """Starts what ends in the next synchronisation: a round (with sharded weights, its next local step)."""
    self.round_start = t
    self.workers_left = len(self.workers)
    for c in self.comms:
      c.waiting = {u: len(self.workers) for u in c.units}
      c.left = len(c.units)
    for w in self.workers:
      for g in w.all_gpus:
        self.log.last.setdefault(g.index, []).append(t)
    for i in range(len(self.workers)):
      self._start_step(i)

  def _start_step(self, i: int) -> None:
    w = self.workers[i]
    self.states[i] = sched.init(len(w.gpus), i)
    self.arrived[i].clear()
    self._inject(i)
    for j in range(len(w.gpus)):
      self._try_start(i, j)

  def _inject(self, i: int) -> None:
    w = self.workers[i]
    while sched.can_inject(self.states[i], w.nm, w.microbatches, self.job.schedule):
      self.states[i], _ = sched.inject(self.states[i], self.job.schedule)

  def _try_start(self, i: int, j: int) -> None:
    arrived, k = self.arrived[i], len(self.workers[i].gpus)

    def has_input(task: sched.Task) -> bool:
      if task.kind == sched.FWD:
        return task.stage == 0 or (task.stage, task.kind, task.mb) in arrived
      return task.stage == k - 1 or (task.stage, task.kind, task.mb) in arrived
    task = sched.pick(self.states[i], j, has_input)
    if task is None:
      return
    self.states[i] = sched.start(self.states[i], task)
    w = self.workers[i]
    fwd, bwd, units, _, flows = self._cost(i, j, w.micro_size(task.mb))
    again = task.kind == sched.BWD and self.job.recompute and task.mb < w.microbatches  # (its forward, checkpointed)
    t = self.sim.t
    finish = lambda t_end: self._finish(i, task, t, t_end)
    scale = 1.0 if self.noise is None else self.noise.task_factor(w.stage_gpus(j), t)
    if flows:  # a split stage: its all-reduces cross its node's link once it has computed
      (f_compute, f_bytes), (b_compute, b_bytes) = flows
      compute, num_bytes = ((f_compute, f_bytes) if task.kind == sched.FWD else
                            (b_compute + (f_compute + self.job.cluster.intra_node.latency_s) * again,
                             b_bytes + f_bytes * again))
      node = w.gpus[j].node
      self.sim.at(t + compute * scale, lambda _t: self.sim.send(node, node, num_bytes, finish))
    else:
      self.sim.at(t + (fwd if task.kind == sched.FWD else bwd + fwd * again) * scale, finish)
    if task.kind == sched.BWD and task.mb == w.microbatches and self.job.overlap and \
        (self.steps[i] + 1 == w.local_steps or self.job.weights_sharded):
      # the synchronisation's last backward: each unit's gradient is final when its part is done
      done = t
      for u, seconds in units:  # the stage's units, last first
        done += seconds
        self.sim.at(done, lambda _t, u=u: self._unit_ready(u, _t))

  def _finish(self, i: int, task: sched.Task, t_start: float, t: float) -> None:
    w = self.workers[i]
    for g in w.stage_gpus(task.stage):
      self.log.compute.setdefault(g.index, []).append((t_start, t, f"{task.kind[0].upper()}{task.mb}"))
      self.log.last[g.index][-1] = t
    self.states[i], _ = sched.finish(self.states[i], task, self.job.schedule)
    nxt = sched.successor(task, len(w.gpus))
    if nxt is not None and nxt[0] != task.stage:
      src, dst = w.gpus[task.stage], w.gpus[nxt[0]]
      num_bytes = self._cost(i, min(task.stage, nxt[0]), w.micro_size(task.mb))[3]
      key = (nxt[0], nxt[1], task.mb)
      self.sim.send(src.node, dst.node, num_bytes,
                    lambda t_landed: self._landed(i, key, dst.index, t, t_landed))
    self._inject(i)
    if self.states[i].completed == w.microbatches:
      self._step_done(i, t)
      return
    for j in range(len(w.gpus)):
      self._try_start(i, j)

  def _landed(self, i: int, key: tuple, gpu: int, t_sent: float, t: float) -> None:
    self.log.inbound.setdefault(gpu, []).append((t_sent, t))
    self.arrived[i].add(key)
    self._try_start(i, key[0])

  def _step_done(self, i: int, t: float) -> None:
    w = self.workers[i]
    self.steps[i] += 1
    if self.steps[i] < w.local_steps and not self.job.weights_sharded:
      self._start_step(i)
      return
    if not self.job.overlap:  # every weight change is ready now, in unit order
      for u in self.tensor_bytes:
        self._unit_ready(u, t)
    self.busy[i] += t - self.round_start
    self.workers_left -= 1
    self._maybe_end_round(t)

  # all-reduce

  def _unit_ready(self, u: int, t: float) -> None:
    comm = self.comm_of.get(u)
    if comm is None:
      return
    comm.waiting[u] -= 1
    if comm.waiting[u]:
      return
    cycle, since = self.job.cycle_s, t - self.round_start  # negotiated at the next cycle's start
    when = self.round_start + math.ceil(since / cycle - 1e-9) * cycle if cycle else t
    self.sim.at(max(when, t), lambda _t: self._negotiated(comm, u))

  def _negotiated(self, comm: _Comm, u: int) -> None:
    comm.ready.append(u)
    self._launch(comm)

  def _launch(self, comm: _Comm) -> None:
    if self.job.exchange != "allreduce":
      self._push(comm)
      return
    if comm.busy or not comm.ready:
      return
    size, taken = 0.0, 0
    for u in comm.ready:
      if taken and size + self.tensor_bytes[u] > self.job.fusion_bytes:
        break
      size += self.tensor_bytes[u]
      taken += 1
    comm.ready = comm.ready[taken:]
    comm.busy = True
    t0 = self.sim.t

    def done(t: float) -> None:
      comm.busy = False
      comm.intervals.append((t0, t))
      comm.left -= taken
      self._launch(comm)
      if comm.left == 0:
        self._maybe_end_round(t)
    allreduce(self.sim, comm.gpus, size, done)

  # parameter server

  def _members(self, comm: _Comm) -> list[tuple[int, int, int]]:
    """Who exchanges with the PS tasks: (its node, the GPUs it stands for, its identity): every GPU (``ps``),
    or every host (``ps_host``)."""
    if self.job.exchange == "ps":
      return [(g.node, 1, g.index) for g in comm.gpus]
    per_node: dict[int, int] = {}
    for g in comm.gpus:
      per_node[g.node] = per_node.get(g.node, 0) + 1
    return [(node, g, node) for node, g in per_node.items()]

  def _push(self, comm: _Comm) -> None:
    """Every ready unit's gradient, from every member (a host: summed inside it first) to the unit's PS task at
    once (no fusion)."""
    ready, comm.ready = comm.ready, []
    members = self._members(comm)
    for u in ready:
      t0, left, ps, size = self.sim.t, [len(members)], self.ps_host[u], self.tensor_bytes[u]

      def landed(t: float, t0=t0, left=left) -> None:
        left[0] -= 1
        if left[0]:
          return
        comm.intervals.append((t0, t))
        comm.left -= 1
        if not any(c.left for c in self.comms):
          self._pull()
      for node, g, _ in members:
        if g > 1:  # summed over the host's PCIe, then pushed
          self.sim.send(node, node, (g - 1) * size,
                        lambda _t, node=node, ps=ps, size=size: self.sim.send(node, ps, size, landed))
        else:
          self.sim.send(node, ps, size, landed)

  def _pull(self) -> None:
    """Every member reads back the variables it holds, each PS task's share in one transfer, and a host copies
    them to its other GPUs (called when the last push has landed, so there is at least one)."""
    shares: dict[tuple[int, int, int, int], float] = {}  # (PS host, node, GPUs, identity) -> bytes
    for c in self.comms:
      for node, g, ident in self._members(c):
        for u in c.units:
          key = (self.ps_host[u], node, g, ident)
          shares[key] = shares.get(key, 0.0) + self.tensor_bytes[u]
    self.pulls_left = len(shares)

    def landed(t_landed: float) -> None:
      self.pulls_left -= 1
      if not self.pulls_left:
        self._maybe_end_round(t_landed)
    for (src, node, g, _), num_bytes in shares.items():
      if g > 1:
        self.sim.send(src, node, num_bytes,
                      lambda _t, node=node, b=(g - 1) * num_bytes: self.sim.send(node, node, b, landed))
      else:
        self.sim.send(src, node, num_bytes, landed)

  def _maybe_end_round(self, t: float) -> None:
    if self.workers_left or any(c.left for c in self.comms) or self.pulls_left:
      return
    self.log.rounds.append((self.round_start, t))
    if self.steps[0] < self.workers[0].local_steps:  # (sharded weights: a micro-step's barrier)
      self._start_sync(t)
      return
    self.rounds_done += 1
    self.examples += sum(w.examples_per_round for w in self.workers)
    if self.job.adapt is not None and self.rounds_done < self.job.rounds:
      self.workers = self.job.adapt.resize(self.workers, self.busy)
    if self.rounds_done == self.job.rounds:
      self.log.comms = [(tuple(g.index for g in c.gpus), c.intervals) for c in self.comms]
      return
    self._start_round(t)
