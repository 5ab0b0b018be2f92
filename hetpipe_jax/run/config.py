"""What a run is: :class:`RunConfig`, made of small frozen parts that each validate themselves.

Example::

  from hetpipe_jax import RunConfig
  from hetpipe_jax.run.config import LayoutSpec, WSPSpec
  config = RunConfig(layout=LayoutSpec(num_vws=2, stages=(2, 2), nm=(2, 2)), wsp=WSPSpec(d=1), waves=20)
  config = RunConfig.of(num_vws=2, stages=(2, 2), nm=(2, 2), d=1, waves=20)   # the same, by flat names
  config.validate()   # ConfigError naming the bad value, its limit and the fix

The parts: :class:`LayoutSpec` (the run's shape), :class:`WSPSpec` (the protocol's knobs),
:class:`OptimizerSpec` (the stages' optimizer and the parameter server's apply rule), :class:`Faults`,
:class:`CheckpointSpec`, and the options of one executor: :class:`~hetpipe_jax.sim.options.SimOptions`
(``sim``), :class:`WallOptions` (``wall``, ``multiprocess``). What an executor accepts is checked by its
registry entry (:mod:`hetpipe_jax.run.executors`), once for every option.

Every field is declared once, with its default and the training CLI's help for it (:func:`setting`, the field's
metadata): :func:`settings` lists them, and ``experiments/run_flags.py`` makes one flag of each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import optax

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.core.controls import DEFAULT as DEFAULT_CONTROL
from hetpipe_jax.core.controls import Control, parse_control
from hetpipe_jax.core.meta import VERSIONS
from hetpipe_jax.core.schedule import SCHEDULES
from hetpipe_jax.core.versions import WEIGHT_MODES
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE
from hetpipe_jax.optim import (
  OPTIMIZERS,
  LrSchedule,
  make_optimizer,
  make_ps_optimizer,
  parse_lr_schedule,
  parse_ps_optimizer,
)
from hetpipe_jax.plan.partition import NM_POLICIES
from hetpipe_jax.plan.placement import PLACEMENTS
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.precision import check_precision
from hetpipe_jax.recompute import check_recompute
from hetpipe_jax.runtime.numerics.ps import ON_NONFINITE
from hetpipe_jax.sim.options import SimOptions

MAX_SEED = 2**63 - 1  # numpy's default_rng takes no negative seed; jax.random.key a C long


def check_seed(seed: int, flag: str = "seed") -> int:
  """``seed`` if numpy and JAX both take it.

  Raises:
    ConfigError: naming the flag, the value and the range [0, 2**63 - 1].
  """
  if not 0 <= seed <= MAX_SEED:
    raise ConfigError(f"--{flag}={seed}; a seed must be in [0, 2**63 - 1] (numpy's default_rng takes no negative "
                      f"seed), e.g. --{flag}=0")
  return seed


def setting(default: Any, doc: str = "", flat: str | None = None) -> Any:
  """A field of :class:`RunConfig` or of one of its parts, declared once for the library and the CLI.

  Args:
    default: the field's default (also its flag's).
    doc: the training CLI's help for its flag (``experiments/run_flags.py`` defines one flag for every field
      that has one); a field without it (a Python object, a path the CLI sets itself) is no flag.
    flat: its name in :meth:`RunConfig.of` and on the command line when not the field's own (``optimizer``
      for :attr:`OptimizerSpec.name`).

  Returns:
    The dataclass field, with ``doc`` and ``flat`` in its metadata (``help``, ``flat``).
  """
  metadata = {"help": doc} if doc else {}
  return dataclasses.field(default=default, metadata={**metadata, **({"flat": flat} if flat else {})})


def _known(name: str, value: Any, known: Collection[str]) -> None:
  if value not in known:
    raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(known)}")


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
  """The run's shape. Per-virtual-worker fields take one value for all or a sequence with one per VW.

  Attributes:
    num_vws: number of virtual workers N.
    stages: devices (stages) per virtual worker, k.
    nm: minibatches per wave (and most in flight) per virtual worker, Nm >= 1; with a policy also a rule
      of the planner's (:data:`hetpipe_jax.plan.partition.NM_POLICIES`): "max_fit", "best", or "speed" (waves
      sized to each virtual worker's speed so that all last about as long, some with a window:
      :mod:`hetpipe_jax.plan.waves`).
    window: most minibatches in flight per virtual worker when fewer than Nm, 1 <= window <= Nm (None:
      Nm); memory grows with it, the wave stays Nm (:mod:`hetpipe_jax.plan.layout`).
    cuts: per virtual worker, unit boundaries ``[0, ..., num_units]``; default: the partitioner's fastest
      cuts for the virtual worker's GPUs in cluster order.
    policy: NP, ED, HD or a grouping of GPU indices: the allocation decides the virtual workers and the
      partitioner their GPU order, cuts and (with an nm rule) Nm; ``num_vws``, ``stages`` and
      ``cuts`` are then not used. A grouping with ``cuts`` is an explicit layout (a tuned plan): each
      group's GPUs in pipeline order, cut at ``cuts``, with ``nm``; nothing is searched.
    placement: PS shard placement: default, local or striped (:mod:`hetpipe_jax.plan.placement`).
    recompute: activation recomputation (:mod:`hetpipe_jax.recompute`): none, selective or full for every
      stage, or auto (each stage the fastest that fits); the stages run it and the cost and memory models charge it.
    tp: each stage's tensor-parallel degree (:mod:`hetpipe_jax.tensor`): the GPUs of one node and type it is
      split over (1: one GPU per stage), taken in cluster order by a layout of ``num_vws`` and ``stages``, or in
      groups of each node's GPUs of one type by a policy's planner (a grouping with cuts names the groups'
      leads, as a tuned plan does); "auto" (with a policy): the degree of the fastest plan; "per_type" (with a
      policy): the fastest degree per GPU type found (:mod:`hetpipe_jax.plan.tensor_groups`).
    time_model: a full-size model (``vgg19``, ``resnet152``, ...): the clock takes task durations from its
      plan on the same GPUs, while the numerics train the run's model (with ``tp`` and a policy the clock's
      stages are split, and the numerics run each stage on its lead GPU: a split stage computes what one
      device does, ``tests/test_tensor_parallel.py``).
  """

  num_vws: int = setting(3, "Number of virtual workers N.")
  stages: int | Sequence[int] = setting(2, "Devices (stages) per virtual worker: one value, or one per VW.")
  nm: int | Sequence[int] | str = setting(
      2, "Minibatches per wave, and most in flight, per virtual worker (Nm >= 1): one, or one per VW; with "
      "--policy also max_fit (the largest that fits), best (the fastest modelled) or speed (waves sized to each VW's "
      "speed: each VW the most minibatches whose wave lasts at most the longest max_fit wave, beyond what fits "
      "with a window; default with --policy: max_fit).")
  window: int | Sequence[int] | None = setting(
      None, "Most minibatches in flight per virtual worker when fewer than Nm (1 <= window <= Nm; memory grows "
      "with it, the wave stays Nm): one, or one per VW (default: Nm).")
  cuts: Sequence[Sequence[int]] | None = setting(
      None, "Unit boundaries of each virtual worker's stages: one list for every VW, e.g. '0,2,5', or one per VW "
      "separated by ';', e.g. '0,2,5;0,3,5'; without --stages they also set the stages (default: the "
      "partitioner's fastest cuts for each VW's GPUs, taken in cluster order).")
  policy: str | Sequence[Sequence[int]] | None = setting(
      None, "Allocation policy NP, ED or HD (or a grouping '0,1;2,3'): the planner then decides virtual workers, "
      "device order, cuts and Nm (--nm=max_fit|best|speed|N).")
  placement: str = setting("default", "PS shard placement: default, local or striped (sim only).")
  recompute: str = setting(
      "none", "Activation recomputation of every stage: none, selective (attention and elementwise ops computed "
      "again in the backward, as Megatron-LM's), full (each unit's forward again), or auto (the planner's choice "
      "per stage: the fastest that fits its GPU's memory).")
  tp: int | str = setting(
      1, "GPUs of one node and type each stage is split over by tensor parallelism (Megatron-LM's split of a GPT "
      "block; 1: none), or with --policy auto (the planner's fastest of 1, 2, 4, 8 that divide the nodes) or "
      "per_type (the fastest degree per GPU type found).")
  time_model: str | None = None

  def validate(self) -> None:
    _known("placement", self.placement, PLACEMENTS)
    check_recompute(self.recompute)
    self._check_tp()
    if isinstance(self.nm, str):
      _known("nm rule", self.nm, NM_POLICIES)
      if self.policy is None:
        raise ConfigError(f"nm={self.nm!r} asks the planner for Nm, which needs a policy: give a policy (NP, ED, "
                          "HD or a grouping of GPU indices), or Nm as a number (one, or one per virtual worker)")
    if self.time_model is not None and self.time_model not in FULL_SIZE:
      raise ConfigError(f"time_model={self.time_model!r}; use one of {', '.join(FULL_SIZE)} (or none)")
    if self.policy is None or self.cuts is None:
      return
    if isinstance(self.policy, str):
      raise ConfigError(f"cuts={self.cuts} and policy={self.policy!r} both fix the cuts; the policy's "
                        "partitioner cuts the model, so drop one of them (or give the policy as a grouping "
                        "of GPU indices in pipeline order, which is then cut as given)")
    if isinstance(self.nm, str):
      raise ConfigError(f"nm={self.nm!r} asks the planner for Nm, but a grouping with cuts is an explicit "
                        "layout: give Nm as a number, or one per virtual worker")

  def _check_tp(self) -> None:
    tp = parse_tp(self.tp)
    object.__setattr__(self, "tp", tp)
    if isinstance(tp, str) and self.policy is None:
      raise ConfigError(f"tp={tp} asks the planner for the tensor-parallel degree, which needs a policy: give a "
                        "policy (NP, ED or HD), or tp as a number")
    if tp != 1 and self.policy is not None and not isinstance(self.policy, str) and (isinstance(tp, str) or
                                                                                    self.cuts is None):
      raise ConfigError(f"tp={tp} with a grouping of GPU indices and no cuts: give a policy (NP, ED or HD), the "
                        "layout by num_vws and stages, or the groups' leads with their cuts and tp as a number (a "
                        "tuned plan's layout)")
    if tp != 1 and self.time_model is not None and self.policy is None:
      raise ConfigError(f"tp={tp} with time_model={self.time_model!r} and a layout by num_vws and stages: the "
                        "clock's cuts of another model are split only on a policy's plan; give a policy (NP, ED "
                        "or HD), or drop one of them")


@dataclasses.dataclass(frozen=True)
class WSPSpec:
  """The protocol's knobs (docs/PROTOCOL.md).

  Attributes:
    d: clock distance bound D >= 0.
    weight_mode: "stash" (a backward uses its forward's weights) or "latest".
    schedule: a device's task order (:data:`hetpipe_jax.core.schedule.SCHEDULES`).
    staleness: the staleness control inside each virtual worker (:mod:`hetpipe_jax.core.controls`).
  """

  d: int = setting(1, "Clock distance bound D >= 0.")
  weight_mode: str = setting("stash", "stash (backward uses its forward's weights) or latest.")
  schedule: str = setting("1f1b", "Device task order: 1f1b (backward first), fifo, or gpipe (a wave's forwards, then "
                          "its backwards, flush between waves).")
  staleness: str = setting(
      DEFAULT_CONTROL, "Staleness control inside a virtual worker: per_minibatch (the paper's: one local update per "
      "minibatch), 2bw:k=K (PipeDream-2BW: gradients of K minibatches summed, one update of their mean, at most one "
      "update of delay, 2 weight versions; k=0: K = Nm), predict (PipeOptim: forwards on the weights the local "
      "optimizer predicts for their backward), pipemare:warmup=T (PipeMare: a delayed update's rate warmed up over T "
      "local updates).")

  @property
  def control(self) -> Control:
    """The parsed staleness control (:mod:`hetpipe_jax.core.controls`)."""
    return parse_control(self.staleness)

  def validate(self) -> None:
    if self.d < 0:
      raise ConfigError(f"D={self.d}; the clock distance bound must be >= 0 (0 = tightest, large = "
                        "asynchronous)")
    _known("weight_mode", self.weight_mode, WEIGHT_MODES)
    _known("schedule", self.schedule, SCHEDULES)
    self.control  # noqa: B018  (a bad spec raises its ConfigError here)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """Attributes:
    name / learning_rate: the local optimizer of every stage (sgd, momentum, adam, adamw, muon), unless ``tx``.
    lr_schedule: the local rate's warm-up and decay over each stage's local updates of the run
      (:class:`hetpipe_jax.optim.LrSchedule`; ``learning_rate`` its peak).
    tx: the stages' local optimizer as an optax transformation (overrides ``name``).
    ps_tx: a parameter server's apply rule of your own, an optax transformation of the pushed summed update
      (None: the one ``ps_optimizer`` names). The executors pass :meth:`server_rule` to the server.
    ps_optimizer: the parameter server's outer optimizer by spec (:func:`hetpipe_jax.optim.parse_ps_optimizer`):
      ``add`` (default: W <- W + the wave's summed update), ``sgd:lr=..``, ``momentum:lr=..,momentum=..``,
      ``nesterov:lr=0.7,momentum=0.9`` (DiLoCo's outer step on the outer gradient -delta), ``avg:lr=..`` (each
      push scaled by lr x its virtual worker's share of a round's examples: lr / N with waves of equal Nm),
      ``delayed_nesterov:lr=..,momentum=..`` (one Nesterov step per N pushes, Async Local-SGD's; ``share=0``
      on either: 1 / N whatever the waves), ``heloco:lr=..,momentum=..`` (averaged pushes corrected against the
      outer momentum, :func:`hetpipe_jax.optim.heloco`); N the run's virtual workers. Not with ``ps_tx``.
    on_nonfinite: a pushed wave update with NaN or Inf is refused before it touches the global weights:
      "stop" ends the run (:class:`~hetpipe_jax.errors.NonFiniteUpdate`, naming VW, wave, stage, unit and
      the last good global clock); "skip" drops that wave's update and goes on (the trace's push event
      says ``"dropped": "nonfinite"``).
  """

  name: str = setting("sgd", "Local optimizer: sgd, momentum, adam, adamw (decoupled weight decay), muon.",
                      flat="optimizer")
  learning_rate: float = setting(0.05, "Local optimizer learning rate (the peak, under --lr_schedule).")
  lr_schedule: str = setting(
      "constant", "The local rate over each stage's local updates of the run: constant, or cosine:warmup=W,final=F "
      "(a linear warm-up over the first W of them, then a cosine decay to F x the rate at the last; cosine alone: "
      "W 0.05, F 0.1).")
  tx: optax.GradientTransformation | None = None
  ps_tx: optax.GradientTransformation | None = None
  on_nonfinite: str = setting(
      "stop", "A pushed update with NaN or Inf: stop the run (one line: VW, wave, stage, unit, last good global "
      "clock) or skip (drop that wave's update, note it in the trace, go on).")
  ps_optimizer: str = setting(
      "add", "The parameter server's outer optimizer on each pushed wave's summed update delta: add (default: W += "
      "delta), sgd:lr=X, momentum:lr=X,momentum=M, nesterov:lr=0.7,momentum=0.9 (DiLoCo's outer Nesterov step "
      "on -delta), avg:lr=X (W += X delta x its virtual worker's share of a round's examples: / N with equal "
      "waves), delayed_nesterov:lr=0.7,momentum=0.9 (one Nesterov step per N pushes: Async Local-SGD; share=0 on "
      "either: / N whatever the waves), heloco:lr=1,momentum=0.9 (averaged pushes, each tensor of a stale one turned "
      "toward the outer momentum: HeLoCo); no effect on the sim executor, which has no numerics.")

  @property
  def ps_spec(self) -> str:
    """The canonical ``ps_optimizer`` (what the trace's meta line records), e.g. ``nesterov:lr=0.7,momentum=0.9``.

    Raises:
      ConfigError: for a bad spec.
    """
    return str(parse_ps_optimizer(self.ps_optimizer))

  def server_rule(self, num_vws: int, wave_examples: Sequence[int] | None = None
                  ) -> optax.GradientTransformation | None:
    """The parameter server's apply rule for ``num_vws`` virtual workers whose waves carry ``wave_examples``
    examples each (None: the same for all): ``ps_tx`` if given, else what ``ps_optimizer`` names (None: add as
    is)."""
    if self.ps_tx is not None:
      return self.ps_tx
    return make_ps_optimizer(self.ps_optimizer, num_vws, wave_examples)

  def validate(self) -> None:
    _known("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
    if self.ps_spec != "add" and self.ps_tx is not None:
      raise ConfigError(f"ps_tx and ps_optimizer={self.ps_optimizer!r} both set the parameter server's apply rule; "
                        "drop one of them (ps_optimizer='add' keeps the given ps_tx)")
    self.schedule  # noqa: B018  (a bad spec raises its ConfigError here)
    if self.tx is not None:
      return
    _known("optimizer", self.name, OPTIMIZERS)
    if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f"learning_rate={self.learning_rate}; use a finite learning rate > 0 (e.g. 0.05)")

  @property
  def schedule(self) -> LrSchedule:
    """The parsed ``lr_schedule``.

    Raises:
      ConfigError: for a bad spec, or a schedule beside ``tx`` (which carries its own rate).
    """
    schedule = parse_lr_schedule(self.lr_schedule)
    if self.tx is not None and not schedule.constant:
      raise ConfigError(f"lr_schedule={self.lr_schedule!r} beside tx: a transformation of your own carries its own "
                        "rate; give it an optax schedule instead, or drop tx")
    return schedule

  def local(self, updates: int = 1) -> optax.GradientTransformation:
    """The stages' local optimizer, its schedule over ``updates`` local updates (a stage's of the run)."""
    return self.tx or make_optimizer(self.name, self.schedule.rate(self.learning_rate, updates))


@dataclasses.dataclass(frozen=True)
class Faults:
  """Fault injection (docs/PROTOCOL.md, membership).

  Attributes:
    failures: (virtual worker, wave) pairs; the virtual worker fails when it reaches that wave (its first
      minibatch), leaves, and the others go on under WSP over the live ones (in a multiprocess run the process of
      its first stage is killed for real when it runs nothing else: docs/PROTOCOL.md section 3.8).
    rejoin: a failed virtual worker is replaced at once: the replacement pulls the global weights and
      enters at the current global clock.
    slow: (node, factor, start, end): every task the node's process starts between ``start`` and ``end`` seconds
      of its clock (from the start of training) lasts ``factor`` times as long, a real delay (the ``multiprocess``
      executor's; a noise file's events slow the ``sim`` executor's GPUs).
  """

  failures: Sequence[tuple[int, int]] = setting(
      (), "Fault injection, VW@WAVE (repeatable): that virtual worker fails when it reaches that wave; the others "
      "go on under WSP without it.")
  rejoin: bool = setting(False, "A failed virtual worker is replaced at once: it pulls the global weights and enters "
                         "at the current global clock.")
  slow: Sequence[tuple[int, float, float, float]] = setting(
      (), "multiprocess: NODE:FACTOR@START-END (repeatable): every task the node's process starts between START and "
      "END seconds from the start of training lasts FACTOR times as long (a real delay).")

  def validate(self, waves: int) -> None:
    for vw, wave in self.failures:
      if not 0 <= wave < waves:
        raise ConfigError(f"fail={vw}@{wave}: the wave must be in 0..{waves - 1} (the run has {waves} waves)")
    for node, factor, start, end in self.slow:
      if not (node >= 0 and 1 <= factor < math.inf and 0 <= start < end):
        raise ConfigError(f"slow={node}:{factor:g}@{start:g}-{end:g}; give a node >= 0, a factor >= 1 (how many times "
                          "as long its tasks last) and 0 <= START < END seconds")

  def slow_of(self, node: int) -> tuple[tuple[float, float, float], ...]:
    """``node``'s slowdowns as (factor, start, end)."""
    return tuple((factor, start, end) for n, factor, start, end in self.slow if n == node)

  def check_vws(self, num_vws: int) -> None:
    """Raises ConfigError for a failure of a virtual worker the layout does not have."""
    for vw, wave in self.failures:
      if not 0 <= vw < num_vws:
        raise ConfigError(f"fail={vw}@{wave}: the run has virtual workers 0..{num_vws - 1}")

  def by_vw(self) -> dict[int, list[int]]:
    """The failures as virtual worker -> waves."""
    out: dict[int, list[int]] = {}
    for vw, wave in self.failures:
      out.setdefault(vw, []).append(wave)
    return out


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  """Attributes:
    directory: save a checkpoint every ``every`` global clock ticks in this directory (orbax), keeping the
      newest ``keep`` (:mod:`hetpipe_jax.runtime.numerics.checkpoint`); None: no checkpoints.
    resume: continue the newest complete checkpoint in ``directory``, appending to the run's trace (what
      the interrupted run wrote after the checkpoint is rolled back); the run then ends as the
      uninterrupted one would (bit for bit on the ``virtual`` executor).
  """

  directory: str | None = setting(
      None, "Save checkpoints here (orbax), every --checkpoint_every global clock ticks; with --resume, continue "
      "the newest complete one (the executors with numerics).", flat="checkpoint_dir")
  every: int = setting(10, "Global clock ticks between checkpoints.", flat="checkpoint_every")
  keep: int = setting(3, "How many of the newest checkpoints to keep.", flat="keep_checkpoints")
  resume: bool = setting(False, "Continue the newest complete checkpoint in --checkpoint_dir, appending to the same "
                         "trace (what the interrupted run wrote after it is rolled back).")

  @property
  def enabled(self) -> bool:
    return bool(self.directory or self.resume)

  def validate(self, trace_path: str | None) -> None:
    if self.resume and not self.directory:
      raise ConfigError("resume needs checkpoint_dir: the directory whose newest checkpoint to continue")
    if self.directory and not trace_path:
      raise ConfigError("checkpoint_dir needs trace_path: a resumed run appends to the trace file it wrote")


@dataclasses.dataclass(frozen=True)
class WallOptions:
  """The ``wall`` (and ``multiprocess``) executor's option.

  Attributes:
    time_scale: pad each task to its emulated duration x this (0: no padding).
  """

  time_scale: float = setting(0.0, "wall executor: pad every task to its emulated duration x this (0: no padding).")

  def set_fields(self) -> list[str]:
    return ["time_scale"] if self.time_scale != 0.0 else []

  def validate(self) -> None:
    if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
      raise ConfigError(f"time_scale={self.time_scale}; use 0 (no padding) or a positive factor")


PARTS = {"layout": LayoutSpec, "wsp": WSPSpec, "optim": OptimizerSpec, "faults": Faults, "checkpoint": CheckpointSpec,
         "sim": SimOptions, "wall": WallOptions}  # RunConfig's parts by their field names


def flat_name(field: dataclasses.Field) -> str:
  """A field's name in :meth:`RunConfig.of` and on the command line."""
  return field.metadata.get("flat", field.name)


# The flat names of RunConfig.of (the CLI's flags) -> (part, field).
FLAT: dict[str, tuple[str, str]] = {flat_name(f): (part, f.name) for part, spec in PARTS.items()
                                    for f in dataclasses.fields(spec)}
FLAT_NAME = {target: name for name, target in FLAT.items()}  # (part, field) -> the flat name users see


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What to run: the run-wide fields and the parts (see the module docstring).

  Attributes:
    cluster: preset name, a TOML file's path, or a :class:`Cluster`.
    executor: "virtual", "wall", "sim" or "multiprocess" (:mod:`hetpipe_jax.run.executors`).
    waves: waves each virtual worker runs.
    batch_size: examples per minibatch.
    seed: initialisation and shuffling seed.
    eval_every: evaluate the global weights every this many global clock ticks (and at the end).
    drop_remainder: drop the examples of an epoch that do not fill a minibatch.
    trace_path: where to write the trace (JSON Lines); it is always kept in memory too.
    trace_version: the trace format's (docs/PROTOCOL.md section 8): 1, every task and pull with its N-entry
      ``glob``; 2, their ``seq`` instead (O(1) per event, for large clusters).
    precision: "fp32", or "fp16"/"bf16": mixed precision, trained by every executor that computes
      (:mod:`hetpipe_jax.runtime.numerics.mixed`) and charged by the cost and memory model
      (:mod:`hetpipe_jax.precision`): the planner's stage times and memory, the clock, the transfers.
    layout / wsp / optim / faults / checkpoint / sim / wall: the parts.
  """

  cluster: str | Cluster = setting("hetero4", "Cluster preset (hetero4, hetero4x4, uniform8, paper_testbed, "
                                   "paper_half, paper_mini, v100_t4) or a .toml file.")
  executor: str = setting("virtual", "virtual (emulated cluster clock, deterministic), wall, sim (cost model with "
                          "shared links, no numerics), or multiprocess (one process per node).")
  waves: int = setting(50, "Waves each virtual worker runs.")
  batch_size: int = setting(32, "Examples per minibatch.")
  seed: int = setting(0, "Initialisation and shuffling seed, in [0, 2**63 - 1].")
  eval_every: int = setting(10, "Evaluate test accuracy every this many global clock ticks.")
  drop_remainder: bool = setting(False, "Drop the examples of an epoch that do not fill a minibatch.")
  trace_path: str | None = None
  trace_version: int = setting(1, "Trace format: 1 (every task and pull with its N-entry glob) or 2 (their seq "
                               "instead: O(1) per event, for large clusters; python -m hetpipe_jax.check TRACE "
                               "--version_1=OUT writes it in version 1). The multiprocess executor writes 1.")
  precision: str = setting("fp32", "fp32, bf16 or fp16: mixed precision (16-bit compute, activations and pushes, "
                           "fp32 master weights and optimizer state; fp16 with dynamic loss scaling) in the training "
                           "(virtual, wall, multiprocess) and in the cost and memory model.")
  layout: LayoutSpec = LayoutSpec()
  wsp: WSPSpec = WSPSpec()
  optim: OptimizerSpec = OptimizerSpec()
  faults: Faults = Faults()
  checkpoint: CheckpointSpec = CheckpointSpec()
  sim: SimOptions = SimOptions()
  wall: WallOptions = WallOptions()

  @classmethod
  def of(cls, **fields: Any) -> RunConfig:
    """A config from flat names (the training CLI's flags: ``d``, ``nm``, ``checkpoint_dir``, ...)."""
    return cls().replace(**fields)

  def replace(self, **fields: Any) -> RunConfig:
    """This config with some fields changed, by their flat names (see :meth:`of`) or a part's name.

    Raises:
      ConfigError: for a name no field has.
    """
    top = {f.name for f in dataclasses.fields(self)}
    parts: dict[str, dict[str, Any]] = {}
    direct = {}
    for name, value in fields.items():
      if name in top:
        direct[name] = value
      elif name in FLAT:
        part, field = FLAT[name]
        parts.setdefault(part, {})[field] = value
      else:
        raise ConfigError(f"RunConfig has no field {name!r}; fields: {', '.join(sorted(top | set(FLAT)))}")
    changed = {part: dataclasses.replace(direct.get(part, getattr(self, part)), **values)
               for part, values in parts.items()}
    return dataclasses.replace(self, **direct, **changed)

  def validate(self) -> None:
    """Checks what does not depend on the model, the layout or the executor's capabilities.

    Raises:
      ConfigError: naming the bad value, its limit and the fix.
    """
    if self.waves < 1:
      raise ConfigError(f"waves={self.waves}; run at least 1 wave")
    if self.eval_every < 1:
      raise ConfigError(f"eval_every={self.eval_every}; evaluate every 1 or more global clock ticks")
    if not 0 <= self.seed <= MAX_SEED:
      raise ConfigError(f"seed={self.seed}; use a seed in [0, 2**63 - 1]")
    check_precision(self.precision)
    if self.trace_version not in VERSIONS:
      raise ConfigError(f"trace_version={self.trace_version}; the trace format has versions "
                        f"{', '.join(map(str, VERSIONS))}")
    self.wsp.validate()
    self.layout.validate()
    self.optim.validate()
    self.wall.validate()
    self.checkpoint.validate(self.trace_path)
    self.faults.validate(self.waves)
    if self.sim.fast and self.faults.failures:
      raise ConfigError("fast_sim extrapolates settled waves, and an injected failure unsettles them: drop "
                        "fast_sim or the failures")


class Setting(NamedTuple):
  """A setting of a run the training CLI takes as a flag: its flat name, its default and its help."""

  name: str
  default: Any
  help: str


def settings() -> list[Setting]:
  """Every field of :class:`RunConfig` and of its parts that has a help text (:func:`setting`), by flat name,
  the run-wide fields first, then each part's in order."""
  fields = [f for f in dataclasses.fields(RunConfig) if f.name not in PARTS]
  fields += [f for spec in PARTS.values() for f in dataclasses.fields(spec)]
  return [Setting(flat_name(f), f.default, f.metadata["help"]) for f in fields if "help" in f.metadata]
