"""Build and run HetPipe: virtual workers on an emulated cluster, a parameter server, an executor.

Example::

  from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe
  result = run_hetpipe(get_model("cnn"), load_dataset("digits"),
                       RunConfig(num_vws=2, stages=(2, 2), nm=(2, 2), d=1, waves=20))
  result.metrics[-1]["test_accuracy"]

A run flows as: config -> validated -> layout (planner or ``stages``/``cuts``) -> runtime (stages on
devices, virtual workers, parameter server) -> executor (``virtual``, ``wall``; ``sim`` has no runtime)
-> result. Every bad configuration raises :class:`ConfigError` before anything runs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.cluster import Cluster, get_cluster
from hetpipe_jax.core import wsp
from hetpipe_jax.core.breakdown import pushed_images
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.core.schedule import SCHEDULES
from hetpipe_jax.core.trace import Trace, write_trace
from hetpipe_jax.core.versions import WEIGHT_MODES
from hetpipe_jax.core.worker import VirtualWorker
from hetpipe_jax.cost.memory import optimizer_slots_of
from hetpipe_jax.cost.profile import UnitProfile, full_size_profiles, profile_units
from hetpipe_jax.data import Dataset, MinibatchStreams, check_batch_size
from hetpipe_jax.errors import ConfigError, NonFiniteUpdate, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.models import FULL_SIZE, FullSize, get_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.optim import OPTIMIZERS, make_optimizer
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.plan.costmodel import CostModel, check_memory
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.manual import fastest_cuts, grouped_layout, manual_layout
from hetpipe_jax.plan.placement import PLACEMENTS, place_shards
from hetpipe_jax.precision import check_precision
from hetpipe_jax.runtime import executors
from hetpipe_jax.runtime.checkpoint import Checkpointer
from hetpipe_jax.runtime.distributed import current_node
from hetpipe_jax.runtime.metrics import WaveMetrics
from hetpipe_jax.runtime.multiprocess import (
  TIMEOUT_S,
  Channel,
  Mailbox,
  RemoteNumerics,
  ShardedServer,
  ShardWorker,
  StageWorker,
  merge_records,
  process_of,
  wait,
)
from hetpipe_jax.runtime.ps import ON_NONFINITE, ParameterServer
from hetpipe_jax.runtime.stage import Device, Stage
from hetpipe_jax.runtime.transport import DeviceComm
from hetpipe_jax.runtime.worker import PipelineNumerics
from hetpipe_jax.sim import simulate, simulate_fast


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What to run. Per-virtual-worker fields take one value for all or a sequence with one per VW.

  Attributes:
    cluster: preset name or a :class:`Cluster`.
    num_vws: number of virtual workers N.
    stages: devices (stages) per virtual worker, k.
    nm: minibatches per wave (and most in flight) per virtual worker, Nm >= 1; with a policy also
      "max_fit" or "best".
    window: most minibatches in flight per virtual worker when fewer than Nm, 1 <= window <= Nm (None:
      Nm); memory grows with it, the wave stays Nm (:mod:`hetpipe_jax.plan.layout`).
    d: clock distance bound D >= 0.
    waves: waves each virtual worker runs.
    batch_size: examples per minibatch.
    optimizer / learning_rate: the local optimizer of every stage (sgd, momentum, adam), or ``tx``.
    ps_tx: the parameter server's apply rule (default: add each pushed wave as is).
    weight_mode: "stash" or "latest".
    schedule: "1f1b" (backward first) or "fifo".
    executor: "virtual", "wall", or "sim" (no numerics: the cost model with link contention and PS
      transfers; metrics then carry no loss or accuracy).
    time_scale: wall executor only: pad each task to its emulated duration x this (0: no padding).
    cuts: per virtual worker, unit boundaries ``[0, ..., num_units]``; default: the partitioner's fastest
      cuts for the virtual worker's GPUs in cluster order.
    seed: initialisation and shuffling seed.
    eval_every: evaluate the global weights every this many global clock ticks (and at the end).
    drop_remainder: drop the examples of an epoch that do not fill a minibatch.
    trace_path: where to write the trace (JSON Lines); it is always kept in memory too.
    policy: NP, ED, HD or a grouping of GPU indices: the allocation decides the virtual workers and the
      partitioner their GPU order, cuts and (with nm "max_fit"/"best") Nm; ``num_vws``, ``stages`` and
      ``cuts`` are then not used.
    placement: PS shard placement of the plan (default or local); recorded in the trace.
    time_model: "vgg19" or "resnet152": the clock (virtual and sim executors, wall padding) takes task
      durations from this full-size model's plan on the same GPUs, while the numerics train ``model``.
    on_nonfinite: a pushed wave update with NaN or Inf is refused before it touches the global weights:
      "stop" ends the run (:class:`~hetpipe_jax.errors.NonFiniteUpdate`, naming VW, wave, stage, unit and
      the last good global clock); "skip" drops that wave's update and goes on (the trace's push event
      says ``"dropped": "nonfinite"``).
    failures: fault injection: (virtual worker, wave) pairs; the virtual worker fails when it reaches
      that wave (its first minibatch), leaves, and the others go on under WSP over the live ones (in a
      multiprocess run its processes are killed for real when they run nothing else).
    rejoin: a failed virtual worker is replaced at once: the replacement pulls the global weights and
      enters at the current global clock.
    checkpoint_dir / checkpoint_every / keep_checkpoints: save a checkpoint every this many global clock
      ticks in this directory (orbax), keeping the newest ones (:mod:`hetpipe_jax.runtime.checkpoint`).
    resume: continue the newest complete checkpoint in ``checkpoint_dir``, appending to ``trace_path``
      (what the interrupted run wrote after the checkpoint is rolled back); the run then ends as the
      uninterrupted one would (bit for bit on the ``virtual`` executor).
    overlap_transfers: sim executor only: a stage's input travels while its device computes other tasks
      (as a GPU's copy engines allow) instead of being received in series inside the task.
    staged_ps: sim executor only: each stage's part of a push leaves as soon as that stage's last backward
      of the wave ends, and each stage's part of a pull lands on its own (the gated forwards wait at each
      stage for that stage's part only) instead of the whole virtual worker's push and pull moving as one
      (:mod:`hetpipe_jax.core.engine`).
    fast_sim: sim executor only: simulate until the waves settle and extrapolate the rest of the run
      (:mod:`hetpipe_jax.sim.steady`; the trace holds the simulated waves, ``seconds`` and ``images`` are
      the whole run's).
    precision: "fp32", or (sim executor only) "fp16"/"bf16": mixed precision in the cost and memory model
      (:mod:`hetpipe_jax.precision`): the planner's stage times and memory, the clock, the transfers.

  A grouping policy with ``cuts`` is an explicit layout (a tuned plan): each group's GPUs in pipeline
  order, cut at ``cuts``, with ``nm`` (one value or one per virtual worker); nothing is searched.
  """

  cluster: str | Cluster = "hetero4"
  num_vws: int = 3
  stages: int | Sequence[int] = 2
  nm: int | Sequence[int] | str = 2
  window: int | Sequence[int] | None = None
  d: int = 1
  waves: int = 50
  batch_size: int = 32
  optimizer: str = "sgd"
  learning_rate: float = 0.05
  tx: optax.GradientTransformation | None = None
  ps_tx: optax.GradientTransformation | None = None
  weight_mode: str = "stash"
  schedule: str = "1f1b"
  executor: str = "virtual"
  time_scale: float = 0.0
  cuts: Sequence[Sequence[int]] | None = None
  seed: int = 0
  eval_every: int = 10
  drop_remainder: bool = False
  trace_path: str | None = None
  policy: str | Sequence[Sequence[int]] | None = None
  placement: str = "default"
  time_model: str | None = None
  on_nonfinite: str = "stop"
  failures: Sequence[tuple[int, int]] = ()
  rejoin: bool = False
  checkpoint_dir: str | None = None
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  resume: bool = False
  overlap_transfers: bool = False
  staged_ps: bool = False
  fast_sim: bool = False
  precision: str = "fp32"


@dataclasses.dataclass
class RunResult:
  """What a run leaves: the global weights, its trace, its metrics and its timing."""

  init_params: tuple[Any, ...] | None  # None for the sim executor (no numerics)
  params: tuple[Any, ...] | None
  events: list[dict[str, Any]]
  metrics: list[dict[str, Any]]
  seconds: float  # on the executor's clock
  wall_seconds: float  # host time the run took
  vws: list[VirtualWorker]
  cuts: list[list[int]]
  images: int  # in the waves pushed to the parameter server
  checkpoints: dict[str, Any] | None = None  # saved by this run: count, seconds and bytes each, resumed from
  fast_sim: dict[str, Any] | None = None  # the sim's fast mode: how the run was extrapolated

  @property
  def images_per_second(self) -> float:
    return self.images / self.seconds if self.seconds > 0 else float("nan")


def time_model_profiles(name: str, batch_size: int) -> list[UnitProfile]:
  """Profiles of a full-size model (``vgg19``, ``resnet152``) at ``batch_size``, for the clock.

  Raises:
    ConfigError: for a model that is not full-size.
  """
  if name not in FULL_SIZE:
    raise ConfigError(f"time_model={name!r}; use one of {', '.join(FULL_SIZE)} (or none)")
  return full_size_profiles(name, batch_size)


def validate(config: RunConfig) -> None:
  """Checks what does not depend on the model or the layout.

  Raises:
    ConfigError: naming the bad value, its limit and the fix.
  """
  if config.d < 0:
    raise ConfigError(f"D={config.d}; the clock distance bound must be >= 0 (0 = tightest, large = "
                      "asynchronous)")
  if config.waves < 1:
    raise ConfigError(f"waves={config.waves}; run at least 1 wave")
  for name, value, known in (("weight_mode", config.weight_mode, WEIGHT_MODES),
                             ("schedule", config.schedule, SCHEDULES),
                             ("executor", config.executor, executors.EXECUTORS),
                             ("placement", config.placement, PLACEMENTS),
                             ("on_nonfinite", config.on_nonfinite, ON_NONFINITE)):
    if value not in known:
      raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(known)}")
  if config.tx is None and config.optimizer not in OPTIMIZERS:
    raise ConfigError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
  if config.eval_every < 1:
    raise ConfigError(f"eval_every={config.eval_every}; evaluate every 1 or more global clock ticks")
  if not (math.isfinite(config.time_scale) and config.time_scale >= 0):
    raise ConfigError(f"time_scale={config.time_scale}; use 0 (no padding) or a positive factor")
  if not 0 <= config.seed < 2**63:
    raise ConfigError(f"seed={config.seed}; use a seed in [0, 2**63 - 1]")
  if config.tx is None and not (math.isfinite(config.learning_rate) and config.learning_rate > 0):
    raise ConfigError(f"learning_rate={config.learning_rate}; use a finite learning rate > 0 (e.g. 0.05)")
  if (config.checkpoint_dir or config.resume) and config.executor == "sim":
    raise ConfigError("checkpoints are for runs with numerics; the sim executor has none (rerunning it is "
                      "cheaper than a checkpoint): drop checkpoint_dir/resume or use another executor")
  if config.overlap_transfers and config.executor != "sim":
    raise ConfigError(f"overlap_transfers is a model of the sim executor; the {config.executor} executor "
                      "receives each task's input in series: drop overlap_transfers or use executor=sim")
  if config.staged_ps and config.executor != "sim":
    raise ConfigError(f"staged_ps is a model of the sim executor; the {config.executor} executor moves a "
                      "virtual worker's push and pull as one: drop staged_ps or use executor=sim")
  if config.placement == "striped" and config.executor == "multiprocess":
    raise ConfigError("placement=striped (byte ranges of every unit on every node) is modelled by the sim "
                      "executor; the multiprocess parameter server holds whole units: use placement=default "
                      "or local")
  if config.fast_sim and config.executor != "sim":
    raise ConfigError(f"fast_sim extrapolates the sim executor's settled waves; the {config.executor} "
                      "executor runs every wave: drop fast_sim or use executor=sim")
  if config.fast_sim and config.failures:
    raise ConfigError("fast_sim extrapolates settled waves, and an injected failure unsettles them: drop "
                      "fast_sim or the failures")
  check_precision(config.precision)
  if config.precision != "fp32" and config.executor != "sim":
    raise ConfigError(f"precision={config.precision!r} is a model of the sim executor; the {config.executor} "
                      "executor trains in fp32: use precision='fp32', or executor='sim'")
  if config.resume and not config.checkpoint_dir:
    raise ConfigError("resume needs checkpoint_dir: the directory whose newest checkpoint to continue")
  if config.checkpoint_dir and not config.trace_path:
    raise ConfigError("checkpoint_dir needs trace_path: a resumed run appends to the trace file it wrote")
  for vw, wave in config.failures:
    if not 0 <= wave < config.waves:
      raise ConfigError(f"fail={vw}@{wave}: the wave must be in 0..{config.waves - 1} (the run has "
                        f"{config.waves} waves)")


def _layouts(config: RunConfig, model: LayeredModel, cluster: Cluster, profiles, clock_profiles,
             optimizer_slots: float) -> tuple[Layout, Layout]:
  """(the layout the numerics run on, the layout the clock times): the same unless ``time_model`` asks
  the clock for a larger model's cuts on the same GPUs; both with ``window``.

  With a policy, the allocation and the partitioner lay out the run; else ``num_vws``, ``stages``,
  ``nm`` and ``cuts`` do.
  """
  layout, clock = _shapes(config, model, cluster, profiles, clock_profiles, optimizer_slots)
  return layout.with_windows(config.window), clock.with_windows(config.window)


def _shapes(config: RunConfig, model: LayeredModel, cluster: Cluster, profiles, clock_profiles,
            optimizer_slots: float) -> tuple[Layout, Layout]:
  """:func:`_layouts` without the window."""
  if config.policy is not None:
    if config.cuts is not None and isinstance(config.policy, str):
      raise ConfigError(f"cuts={config.cuts} and policy={config.policy!r} both fix the cuts; the policy's "
                        "partitioner cuts the model, so drop one of them (or give the policy as a grouping "
                        "of GPU indices in pipeline order, which is then cut as given)")
    if config.cuts is not None and not isinstance(config.policy, str):
      if isinstance(config.nm, str):
        raise ConfigError(f"nm={config.nm!r} asks the planner for Nm, but a grouping with cuts is an explicit "
                          "layout: give Nm as a number, or one per virtual worker")
      clock = grouped_layout(cluster, clock_profiles, config.policy, config.cuts, config.nm, config.weight_mode,
                             optimizer_slots, config.precision, config.window)
    else:
      nm = config.nm if isinstance(config.nm, (str, int)) else list(config.nm)
      clock = plan_cluster(cluster, clock_profiles, config.policy, config.placement,
                           nm[0] if isinstance(nm, list) and len(nm) == 1 else nm, None, config.weight_mode,
                           optimizer_slots, config.precision).layout
    if config.time_model is None:
      return clock, clock
    return fastest_cuts(cluster, profiles, clock.gpus, clock.nms, config.weight_mode, optimizer_slots,
                        config.precision), clock
  layout = manual_layout(cluster, profiles, config.num_vws, config.stages, config.nm, config.cuts,
                         config.weight_mode, optimizer_slots, model.name, config.precision)
  if config.time_model is None:
    return layout, layout
  return layout, fastest_cuts(cluster, clock_profiles, layout.gpus, layout.nms, config.weight_mode,
                              optimizer_slots, config.precision)


def _jax_devices(count: int) -> list[Device]:
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(
        f"this run places {count} emulated GPUs but JAX has {len(devices)} devices; on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts (experiments/train.py "
        "does it for you), or use fewer virtual workers or stages")
  return devices


def _meta(config: RunConfig, cluster: Cluster, model_name: str, dataset_name: str, num_units: int,
          layout: Layout) -> dict[str, Any]:
  """The trace's meta line of a run."""
  shape = layout.meta()
  return dict(ev="meta", version=1, num_vws=shape["num_vws"], nm=shape["nm"], d=config.d,
              stages=shape["stages"], weight_mode=config.weight_mode, executor=config.executor,
              schedule=config.schedule, shards=num_units, model=model_name, dataset=dataset_name,
              batch_size=config.batch_size, cuts=shape["cuts"], gpus=shape["gpus"], cluster=cluster.name,
              seed=config.seed, policy=config.policy, placement=config.placement,
              time_model=config.time_model, **({"overlap_transfers": True} if config.overlap_transfers else {}),
              **({"window": shape["window"]} if "window" in shape else {}),
              **({"precision": config.precision} if config.precision != "fp32" else {}))


def _param_shapes(model: LayeredModel, sample_x, data_name: str):
  """The shapes of ``model``'s parameters on inputs like ``sample_x``.

  Raises:
    ConfigError: when the model cannot take that input (say which model, which input, and what would).
  """
  try:
    return jax.eval_shape(model.init, jax.random.key(0), sample_x)
  except Exception as e:  # pylint: disable=broad-except  # layers fail in many ways on a too-small input
    shape = "x".join(map(str, sample_x.shape[1:]))
    full = [name for name, size in FULL_SIZE.items() if get_model(name).name == model.name]
    hint = (f"{full[0]} is a full-size model for {'x'.join(map(str, FULL_SIZE[full[0]].input_shape))} inputs: "
            "simulate it without data (executor sim), or train mlp, cnn, vgg or resnet on this dataset"
            if full else "choose a model whose layers fit this input, or a dataset with larger inputs")
    raise ConfigError(f"model {model.name!r} cannot take {data_name}'s {shape} inputs "
                      f"({str(e).splitlines()[0][:120]}); {hint}") from None


def run_hetpipe(model: LayeredModel, dataset: Dataset | FullSize, config: RunConfig) -> RunResult:
  """Trains ``model`` on ``dataset`` with N virtual workers under WSP; see :class:`RunConfig`.

  ``dataset`` may be a :class:`~hetpipe_jax.models.FullSize` input description instead (the ``sim``
  executor runs no numerics, so it needs no data: e.g. VGG-19 at its 224x224 ImageNet input, or a GPT
  at a sequence length, :func:`~hetpipe_jax.models.full_size_spec`).

  Raises:
    ConfigError: for a configuration that cannot run, before anything runs.
  """
  validate(config)
  if isinstance(dataset, FullSize):
    if config.executor != "sim":
      raise ConfigError(f"executor={config.executor!r} trains on data, but the run has only an input shape "
                        f"{dataset.input_shape}; give a dataset, or simulate (executor='sim')")
    sample_x = jax.ShapeDtypeStruct((config.batch_size, *dataset.input_shape), jnp.dtype(dataset.dtype))
    data_name = f"none (input {'x'.join(map(str, dataset.input_shape))}, {dataset.num_classes} classes)"
  else:
    check_batch_size(dataset, config.batch_size, config.drop_remainder)
    sample_x = jnp.asarray(dataset.x_train[:config.batch_size])
    data_name = dataset.name
  cluster = get_cluster(config.cluster) if isinstance(config.cluster, str) else config.cluster
  tx = config.tx or make_optimizer(config.optimizer, config.learning_rate)
  param_shapes = _param_shapes(model, sample_x, data_name)
  profiles = profile_units(model, sample_x)
  slots = optimizer_slots_of(tx, param_shapes)
  # The clock's model: the trained one, or a larger one (time_model) whose plan sets the durations.
  clock_profiles = profiles if config.time_model is None else time_model_profiles(config.time_model,
                                                                                  config.batch_size)
  layout, clock_layout = _layouts(config, model, cluster, profiles, clock_profiles, slots)
  for vw, wave in config.failures:
    if not 0 <= vw < layout.num_vws:
      raise ConfigError(f"fail={vw}@{wave}: the run has virtual workers 0..{layout.num_vws - 1}")
  meta = _meta(config, cluster, model.name, data_name, model.num_units, layout)
  if config.executor == "sim":
    return _simulate(config, cluster, clock_profiles, clock_layout, meta)
  assert isinstance(dataset, Dataset)  # a FullSize input was refused above for every other executor
  check_memory(profiles, layout, config.weight_mode, slots, config.precision)
  if config.executor == "multiprocess":
    return _train_multiprocess(model, dataset, config, tx, cluster, CostModel(cluster, clock_profiles, clock_layout),
                               layout, meta, sample_x, profiles)
  return _train(model, dataset, config, tx, CostModel(cluster, clock_profiles, clock_layout), layout, meta,
                sample_x)


def _build(model: LayeredModel, layout: Layout, config: RunConfig, tx: optax.GradientTransformation,
           init_params, devices: list[Device]) -> tuple[list[VirtualWorker], list[PipelineNumerics],
                                                        ParameterServer]:
  """The runtime of ``layout``: every stage on its GPU's device, the virtual workers and their numerics,
  the server."""
  device_of = {(i, j): devices[gpu.index] for i, vw in enumerate(layout.vws) for j, gpu in enumerate(vw.gpus)}
  comm = DeviceComm(device_of)
  numerics = [PipelineNumerics(i, [Stage(model, units.start, units.stop, init_params[units.start:units.stop],
                                         device_of[(i, j)], tx, vw.nm, config.weight_mode)
                                   for j, _, units in vw.stages()], comm)
              for i, vw in enumerate(layout.vws)]
  vws = [VirtualWorker.create(i, vw.k, vw.nm, config.waves * vw.nm, layout.num_vws, config.schedule,
                              config.weight_mode, numerics[i], vw.window) for i, vw in enumerate(layout.vws)]
  server = ParameterServer(init_params, layout.num_vws, config.d, config.ps_tx, on_nonfinite=config.on_nonfinite)
  return vws, numerics, server  # the server on the host CPU


def _failures(config: RunConfig) -> dict[int, list[int]]:
  """``config.failures`` as virtual worker -> waves."""
  out: dict[int, list[int]] = {}
  for vw, wave in config.failures:
    out.setdefault(vw, []).append(wave)
  return out


def _require_pushes(rows: Sequence[dict[str, Any]]) -> None:
  """Raises RunStopped when no wave reached the parameter server (every virtual worker failed first)."""
  if not rows:
    raise RunStopped("every virtual worker failed before pushing a wave, so nothing was trained; inject "
                     "failures at later waves, or let replacements join (rejoin)")


def _trained_images(events: Sequence[dict[str, Any]], batch_size: int) -> int:
  """Images in the waves pushed to the parameter server (work a failure dropped does not count)."""
  return sum(pushed_images(events, batch_size))


def _identity(config: RunConfig, meta: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint's run is: a resume must match every entry."""
  fields = ("optimizer", "learning_rate", "waves", "eval_every", "drop_remainder", "on_nonfinite", "rejoin")
  return {**{k: v for k, v in meta.items() if k not in ("ev", "version")},
          **{k: getattr(config, k) for k in fields}, "custom_tx": config.tx is not None or config.ps_tx is not None}


def _run_engine(model: LayeredModel, dataset: Dataset, config: RunConfig, layout: Layout, meta: dict[str, Any],
                vws: list[VirtualWorker], server, batches, run, init_params, eval_device: Device,
                numerics: Sequence[Any] = ()) -> RunResult:
  """Writes the trace's meta line, runs the engine with ``run(engine, resume, between) -> seconds``,
  evaluates, and returns the result (``server`` holds the clocks and has the global ``params``).

  With ``config.checkpoint_dir``, ``between`` saves a checkpoint of the engine, ``numerics``, the server,
  the metrics and the trace every ``checkpoint_every`` global clock ticks; with ``config.resume`` the
  run first restores the newest one and ``resume`` is the executor's clock to continue from.
  """
  evaluate = make_evaluator(model, dataset, eval_device)
  checkpointer = state = None
  if config.checkpoint_dir:
    checkpointer = Checkpointer(config.checkpoint_dir, config.checkpoint_every, config.keep_checkpoints,
                                _identity(config, meta))
    if config.resume:
      step = checkpointer.latest()
      if step is None:
        raise ConfigError(f"resume: no complete checkpoint in {config.checkpoint_dir}; run without resume to "
                          "start afresh")
      state, _ = checkpointer.restore(step)
      state["step"] = step
  if state is None:
    trace = Trace(config.trace_path)
    trace.emit(**meta)
  else:
    assert config.trace_path is not None  # validate() asks for it with a checkpoint_dir
    trace = Trace.resume(config.trace_path, state["trace_events"])
  metrics = WaveMetrics(server, layout.nms, config.waves, config.eval_every)
  engine = Engine(vws, server, trace, batches, metrics.on_wave, failures=_failures(config), rejoin=config.rejoin)
  resume: executors.VirtualClock | None = None
  if state is not None:
    engine.restore_host_state(state["engine"])
    server.restore_checkpoint_state(state["server"])
    for worker, worker_state in zip(numerics, state["numerics"]):
      worker.restore_checkpoint_state(worker_state)
    metrics.restore_checkpoint_state(state["metrics"])
    resume = executors.VirtualClock(**state["clock"])
  def save(clock: executors.VirtualClock) -> None:
    assert checkpointer is not None
    step = wsp.c_global(server.clock)
    trace.flush()
    checkpointer.save(step, {
        "engine": engine.host_state(), "server": server.checkpoint_state(),
        "numerics": [worker.checkpoint_state() for worker in numerics],
        "metrics": metrics.checkpoint_state(evaluate), "trace_events": len(trace.events),
        "clock": {"t": clock.t, "heap": list(clock.heap), "seq": clock.seq}}, {"virtual_time": clock.t})
  between = None if checkpointer is None else executors.Checkpointing(
      lambda: checkpointer.due(wsp.c_global(server.clock)), save)
  t_host = time.perf_counter()
  try:
    seconds = run(engine, resume, between)
    final = server.params
    jax.block_until_ready(final)
  except NonFiniteUpdate as e:  # name the stage too, for the user
    raise e.with_stages(layout.cuts[e.vw]) from None
  finally:
    trace.close()
    if checkpointer is not None:
      checkpointer.close()
  wall_seconds = time.perf_counter() - t_host
  _require_pushes(metrics.rows)
  rows = metrics.finish(final, evaluate)
  images = _trained_images(trace.events, config.batch_size)
  stats = None if checkpointer is None else {
      "directory": checkpointer.directory, "saved": len(checkpointer.seconds), "seconds": checkpointer.seconds,
      "bytes": checkpointer.bytes, "resumed_from": None if state is None else state["step"]}
  return RunResult(init_params, final, trace.events, rows, seconds, wall_seconds, vws, layout.cuts, images, stats)


def _wall_runner(config: RunConfig, cost: executors.CostFn, **kw):
  """``run(engine, resume, between)`` on the ``wall`` executor, padded to ``cost`` when ``time_scale`` > 0."""
  return lambda engine, resume, between: executors.run_wall(
      engine, cost if config.time_scale > 0 else None, config.time_scale, resume=resume, between=between, **kw)


def _train(model: LayeredModel, dataset: Dataset, config: RunConfig, tx: optax.GradientTransformation,
           cost_model: CostModel, layout: Layout, meta: dict[str, Any], sample_x) -> RunResult:
  """Runs the ``virtual`` or ``wall`` executor with real numerics."""
  batches = MinibatchStreams(dataset, config.batch_size, layout.num_vws, config.seed, config.drop_remainder)
  devices = _jax_devices(max(g.index for group in layout.gpus for g in group) + 1)
  init_params = model.init(jax.random.key(config.seed), sample_x)
  vws, numerics, ps = _build(model, layout, config, tx, init_params, devices)
  cost = lambda task: cost_model.task_seconds(task.vw, task.stage, task.kind)
  x0, y0 = batches(0, 1)
  for worker in numerics:  # compile before the clock starts
    worker.warm_up(x0, y0)
  ps.warm_up()
  if config.executor == "virtual":
    run = lambda engine, resume, between: executors.run_virtual(engine, cost, resume, between)
  else:
    run = _wall_runner(config, cost)
  return _run_engine(model, dataset, config, layout, meta, vws, ps, batches, run, init_params, devices[0],
                     numerics)


def _train_multiprocess(model: LayeredModel, dataset: Dataset, config: RunConfig, tx: optax.GradientTransformation,
                        cluster: Cluster, cost_model: CostModel, layout: Layout, meta: dict[str, Any],
                        sample_x, profiles: Sequence[UnitProfile]) -> RunResult:
  """One process of a ``multiprocess`` run (see :mod:`hetpipe_jax.runtime.multiprocess`): every process
  runs its node's stages and PS shards; process 0 also runs the engine and returns the run's result."""
  node = current_node()
  nodes = sorted({g.node for g in cluster.gpus})
  if node is None:
    raise ConfigError("executor=multiprocess runs one process per node: start it with `python -m "
                      "experiments.train --executor=multiprocess` (it launches them), or join the job first")
  if node.num_processes != len(nodes):
    raise ConfigError(f"num_processes={node.num_processes} but cluster {cluster.name!r} has {len(nodes)} nodes; "
                      "run one process per node")
  streams = MinibatchStreams(dataset, config.batch_size, layout.num_vws, config.seed, config.drop_remainder)
  init_params = model.init(jax.random.key(config.seed), sample_x)  # the same in every process
  owners = process_of(layout, nodes)
  shard_owners = [nodes.index(n) for n in place_shards(cluster, profiles, layout, config.placement)]
  local = jax.local_devices()
  mailbox = Mailbox()
  mine = [u for u, p in enumerate(shard_owners) if p == node.process]
  threads = []
  if mine:  # this process holds these units' PS shards, in host memory
    threads.append(ShardWorker(node, mine, [init_params[u] for u in mine], layout.num_vws, config.d, config.ps_tx,
                               owners, layout.cuts, mailbox).thread)
  x0, y0 = streams(0, 1)
  for (i, j), process in owners.items():
    if process != node.process:
      continue
    vw = layout.vws[i]
    units, gpu = vw.stage_units(j), vw.gpus[j]
    device = local[[g.index for g in cluster.node_gpus(gpu.node)].index(gpu.index)]
    stage = Stage(model, units.start, units.stop, init_params[units.start:units.stop], device, tx, vw.nm,
                  config.weight_mode)
    x = model.apply(init_params[:units.start], jnp.asarray(x0), 0, units.start)  # the stage's input shape
    stage.warm_up(x, jax.device_put(y0, device) if stage.is_last else None)
    threads.append(StageWorker(node, i, j, stage, vw.nm, owners, shard_owners, streams, mailbox).thread)
  node.connect_all()
  for thread in threads:
    thread.start()
  node.barrier("hetpipe_jax/ready", 600)  # every stage compiled and connected before the clock starts
  if node.process != 0:
    for thread in threads:
      thread.join()
    node.close()
    return RunResult(None, None, [], [], 0.0, 0.0, [], layout.cuts, 0)

  def on_gone(p: int) -> str | None:  # a lost process: its virtual workers leave, unless it held PS shards
    units = [u for u, owner in enumerate(shard_owners) if owner == p]
    return None if not units else (
        f"process {p} (node {nodes[p]}) is gone, and with it the PS shards of units {units}: the global weights "
        "are lost; resume from the newest checkpoint (--checkpoint_dir with --resume), or keep the shards "
        "off nodes that may fail (--placement)")

  node.watch(on_gone)
  channels = {p: Channel(node, f"ps{p}", p, f"the PS shards of process {p}") for p in sorted(set(shard_owners))}
  server = ShardedServer(node, layout.num_vws, config.d, shard_owners, channels, mailbox,
                         [jax.tree.structure(p) for p in init_params])
  numerics = [RemoteNumerics(node, i, vw.cuts, vw.nm, owners, shard_owners, channels, mailbox,
                             check_finite=config.on_nonfinite == "skip") for i, vw in enumerate(layout.vws)]
  vws = [VirtualWorker.create(i, vw.k, vw.nm, config.waves * vw.nm, layout.num_vws, config.schedule,
                              config.weight_mode, numerics[i], vw.window) for i, vw in enumerate(layout.vws)]
  run = _wall_runner(config, lambda task: cost_model.task_seconds(task.vw, task.stage, task.kind), wait=wait)

  def stop_all() -> None:  # every command posted so far is executed first
    for n in numerics:
      n.stop()
    for channel in channels.values():
      channel.post(op="stop")
    for thread in threads:
      thread.join(timeout=TIMEOUT_S)  # a thread still waiting for a lost process is left behind
    node.close()

  try:
    result = _run_engine(model, dataset, config, layout, meta, vws, server, None, run, init_params, local[0],
                         numerics)
  except (ConfigError, RunStopped):  # stopped on purpose (e.g. a non-finite update): every process ends cleanly
    node.stop_job()  # a command still waiting for what will never come gives up
    stop_all()
    raise
  # on any other failure nothing is cleaned up here: the process ends at once (Node.abort)
  merge_records(result.events, numerics)  # every process's own records of its tasks, into the one trace
  if config.trace_path:
    write_trace(config.trace_path, result.events)
  stop_all()
  return result


def _simulate(config: RunConfig, cluster: Cluster, profiles, layout: Layout, meta: dict[str, Any]) -> RunResult:
  """The ``sim`` executor: the same engine on the cost model with link contention, no numerics."""
  trace = Trace(config.trace_path)
  t_host = time.perf_counter()
  meta = {**meta, "shards": len(profiles), "cuts": layout.cuts}
  fast = None
  try:
    if config.fast_sim:
      seconds, vws, rows, fast = simulate_fast(cluster, profiles, layout, config.d, config.waves, trace,
                                               config.placement, config.schedule, config.weight_mode,
                                               config.precision, meta=meta,
                                               overlap_transfers=config.overlap_transfers,
                                               staged_ps=config.staged_ps)
    else:
      seconds, vws, rows = simulate(cluster, profiles, layout, config.d, config.waves, trace, config.placement,
                                    config.schedule, config.weight_mode, config.precision, meta=meta,
                                    failures=_failures(config), rejoin=config.rejoin,
                                    overlap_transfers=config.overlap_transfers, staged_ps=config.staged_ps)
  finally:
    trace.close()
  _require_pushes(rows)
  images = (config.batch_size * config.waves * sum(layout.nms) if fast is not None
            else _trained_images(trace.events, config.batch_size))
  return RunResult(None, None, trace.events, rows, seconds, time.perf_counter() - t_host, vws, layout.cuts,
                   images, fast_sim=fast)
