"""Build and run HetPipe: virtual workers on an emulated cluster, a parameter server, an executor.

Example::

  from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe
  result = run_hetpipe(get_model("cnn"), load_dataset("digits"),
                       RunConfig(num_vws=2, stages=(2, 2), nm=(2, 2), d=1, waves=20))
  result.metrics[-1]["test_accuracy"]

Every bad configuration raises :class:`ConfigError` before anything runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from hetpipe_jax.core import wsp
from hetpipe_jax.runtime import executors
from hetpipe_jax.plan.allocation import PLACEMENTS, plan_cluster
from hetpipe_jax.cluster.topology import Cluster, assign_gpus, get_cluster
from hetpipe_jax.data import Dataset, MinibatchStreams, check_batch_size
from hetpipe_jax.core.engine import Engine
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE_INPUT, get_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.core.pipeline import SCHEDULES, VirtualWorker
from hetpipe_jax.cost.profile import nbytes, profile_units
from hetpipe_jax.plan.costmodel import CostModel, check_memory
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.runtime.ps import ParameterServer
from hetpipe_jax.sim.simulate import simulate
from hetpipe_jax.runtime.stage import WEIGHT_MODES, Stage
from hetpipe_jax.core.trace import Trace

OPTIMIZERS = {
    "sgd": optax.sgd,
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "adam": optax.adam,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What to run. Per-virtual-worker fields take one value for all or a sequence with one per VW.

  Attributes:
    cluster: preset name or a :class:`Cluster`.
    num_vws: number of virtual workers N.
    stages: devices (stages) per virtual worker, k.
    nm: most minibatches in flight per virtual worker, Nm >= 1; with a policy also "max_fit" or "best".
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
  """

  cluster: str | Cluster = "hetero4"
  num_vws: int = 3
  stages: int | Sequence[int] = 2
  nm: int | Sequence[int] | str = 2
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
  images: int

  @property
  def images_per_second(self) -> float:
    return self.images / self.seconds if self.seconds > 0 else float("nan")


def _per_vw(name: str, value, n: int) -> list[int]:
  values = [value] * n if isinstance(value, int) else list(value)
  if len(values) != n:
    raise ConfigError(f"{name} has {len(values)} values {values} for {n} virtual workers; give one "
                      "value, or one per virtual worker")
  return values


def time_model_profiles(name: str, batch_size: int):
  """Profiles of a full-size model (``vgg19``, ``resnet152``) at ``batch_size``, for the clock."""
  if name not in FULL_SIZE_INPUT:
    raise ConfigError(f"time_model={name!r}; use one of {', '.join(FULL_SIZE_INPUT)} (or none)")
  shape = jax.ShapeDtypeStruct((batch_size,) + FULL_SIZE_INPUT[name], jnp.float32)
  return profile_units(get_model(name, 1000), shape)


def _check(config: RunConfig) -> None:
  """Validates what does not depend on the model or the layout."""
  if config.d < 0:
    raise ConfigError(f"D={config.d}; the clock distance bound must be >= 0 (0 = tightest, large = "
                      "asynchronous)")
  if config.waves < 1:
    raise ConfigError(f"waves={config.waves}; run at least 1 wave")
  for name, value, known in (("weight_mode", config.weight_mode, WEIGHT_MODES),
                             ("schedule", config.schedule, SCHEDULES),
                             ("executor", config.executor, executors.EXECUTORS),
                             ("placement", config.placement, PLACEMENTS)):
    if value not in known:
      raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(known)}")
  if config.tx is None and config.optimizer not in OPTIMIZERS:
    raise ConfigError(f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
  if config.eval_every < 1:
    raise ConfigError(f"eval_every={config.eval_every}; evaluate every 1 or more global clock ticks")
  if config.time_scale < 0:
    raise ConfigError(f"time_scale={config.time_scale}; use 0 (no padding) or a positive factor")


def manual_layout(config: RunConfig, model: LayeredModel, cluster: Cluster, profiles,
                  optimizer_slots: float) -> Layout:
  """The layout from ``num_vws``, ``stages``, ``nm`` and ``cuts``: GPUs in cluster order; without cuts,
  the partitioner's fastest cuts for each virtual worker's GPUs in that order.

  Raises:
    ConfigError: naming the bad value, its limit and the fix.
  """
  if config.num_vws < 1:
    raise ConfigError(f"num_vws={config.num_vws}; at least 1 virtual worker is needed")
  if isinstance(config.nm, str):
    raise ConfigError(f"nm={config.nm!r} picks Nm from a plan; give a number, or a policy (NP, ED, HD)")
  stages = _per_vw("stages", config.stages, config.num_vws)
  nms = _per_vw("nm", config.nm, config.num_vws)
  for i, nm in enumerate(nms):
    if nm < 1:
      raise ConfigError(f"Nm={nm} for virtual worker {i}; Nm (minibatches in flight) must be >= 1")
  for i, k in enumerate(stages):
    if k > model.num_units:
      raise ConfigError(f"virtual worker {i} has {k} stages but model {model.name} has only "
                        f"{model.num_units} units to cut; use at most {model.num_units} stages")
  gpus = assign_gpus(cluster, stages)  # raises when the cluster is too small
  if config.cuts is None:
    return fastest_cuts(cluster, profiles, gpus, nms, config.weight_mode, optimizer_slots)
  cuts = [list(c) for c in config.cuts]
  if len(cuts) != config.num_vws:
    raise ConfigError(f"cuts has {len(cuts)} entries for {config.num_vws} virtual workers")
  for i, (cut, k) in enumerate(zip(cuts, stages)):
    if (len(cut) != k + 1 or cut[0] != 0 or cut[-1] != model.num_units
        or any(a >= b for a, b in zip(cut, cut[1:]))):
      raise ConfigError(f"cuts {cut} of virtual worker {i} must be {k + 1} increasing boundaries from 0 "
                        f"to {model.num_units} (k={k} non-empty stages)")
  return Layout(tuple(VWLayout(tuple(g), tuple(c), nm) for g, c, nm in zip(gpus, cuts, nms)))


def fastest_cuts(cluster: Cluster, profiles, gpus, nms, weight_mode: str, optimizer_slots: float) -> Layout:
  """Each virtual worker's GPUs kept in the given order, cut by the partitioner for the fastest stages."""
  return Layout(tuple(partition(cluster, profiles, g, nm, weight_mode, optimizer_slots, ordered=True).layout
                      for g, nm in zip(gpus, nms)))


def planned_layout(config: RunConfig, cluster: Cluster, profiles, optimizer_slots: float) -> Layout:
  """GPUs (pipeline order), Nm and cuts per virtual worker from the allocation policy and partitioner."""
  if config.cuts is not None:
    raise ConfigError(f"cuts={config.cuts} and policy={config.policy!r} both fix the cuts; the policy's "
                      "partitioner cuts the model, so drop one of them")
  nm = config.nm if isinstance(config.nm, str) else _per_vw("nm", config.nm, 1)[0]
  return plan_cluster(cluster, profiles, config.policy, config.placement, nm, None, config.weight_mode,
                      optimizer_slots).layout


def layouts(config: RunConfig, model: LayeredModel, cluster: Cluster, profiles, clock_profiles,
            optimizer_slots: float) -> tuple[Layout, Layout]:
  """(the layout the numerics run on, the layout the clock times): the same unless ``time_model`` asks
  the clock for a larger model's cuts on the same GPUs."""
  if config.policy is not None:
    clock = planned_layout(config, cluster, clock_profiles, optimizer_slots)
    if config.time_model is None:
      return clock, clock
    return fastest_cuts(cluster, profiles, clock.gpus, clock.nms, config.weight_mode, optimizer_slots), clock
  layout = manual_layout(config, model, cluster, profiles, optimizer_slots)
  if config.time_model is None:
    return layout, layout
  return layout, fastest_cuts(cluster, clock_profiles, layout.gpus, layout.nms, config.weight_mode,
                              optimizer_slots)


def _jax_devices(count: int) -> list[jax.Device]:
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(
        f"this run places {count} emulated GPUs but JAX has {len(devices)} devices; on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts (experiments/train.py "
        "does it for you), or use fewer virtual workers or stages")
  return devices


def run_hetpipe(model: LayeredModel, dataset: Dataset, config: RunConfig) -> RunResult:
  """Trains ``model`` on ``dataset`` with N virtual workers under WSP; see :class:`RunConfig`."""
  _check(config)
  check_batch_size(dataset, config.batch_size, config.drop_remainder)
  cluster = get_cluster(config.cluster) if isinstance(config.cluster, str) else config.cluster
  tx = config.tx or OPTIMIZERS[config.optimizer](config.learning_rate)
  sample_x = jnp.asarray(dataset.x_train[:config.batch_size])
  profiles = profile_units(model, sample_x)
  param_shapes = jax.eval_shape(model.init, jax.random.key(0), sample_x)
  slots = nbytes(jax.eval_shape(tx.init, param_shapes)) / max(nbytes(param_shapes), 1)  # opt. state / params
  # The clock's model: the trained one, or a larger one (time_model) whose plan sets the durations.
  clock_profiles = profiles if config.time_model is None else time_model_profiles(config.time_model,
                                                                                  config.batch_size)
  layout, clock_layout = layouts(config, model, cluster, profiles, clock_profiles, slots)
  num_vws, stages, nms, cuts, gpus = (layout.num_vws, layout.stages, layout.nms, layout.cuts, layout.gpus)
  if config.executor == "sim":
    return _simulate(config, cluster, model.name, dataset.name, clock_profiles, clock_layout)
  batches = MinibatchStreams(dataset, config.batch_size, num_vws, config.seed, config.drop_remainder)
  devices = _jax_devices(max(g.index for group in gpus for g in group) + 1)
  check_memory(profiles, layout, config.weight_mode, slots)
  init_params = model.init(jax.random.key(config.seed), sample_x)
  cost_model = CostModel(cluster, clock_profiles, clock_layout)
  cost = lambda task: cost_model.task_seconds(task.vw, task.stage, task.kind)

  vws = []
  for i in range(num_vws):
    stage_objs = [Stage(model, cuts[i][j], cuts[i][j + 1], init_params[cuts[i][j]:cuts[i][j + 1]],
                        devices[gpus[i][j].index], tx, nms[i], config.weight_mode)
                  for j in range(stages[i])]
    vws.append(VirtualWorker(i, stages[i], nms[i], config.waves * nms[i], num_vws,
                             config.schedule, config.weight_mode, stage_objs))
  ps = ParameterServer(init_params, num_vws, config.d, config.ps_tx, devices[0])

  trace = Trace(config.trace_path)
  trace.emit(**_meta(config, cluster, model.name, dataset.name, model.num_units, layout))

  rows: list[dict[str, Any]] = []
  snapshots: list[tuple[int, Any]] = []  # (row index, global params) to evaluate after the run
  total_waves = config.waves * num_vws
  state = {"clock": 0, "waves": 0}

  def on_wave(vw: int, wave: int, t: float, losses: list) -> None:
    state["waves"] += 1
    clock = wsp.c_global(ps.clock)
    rows.append({"vw": vw, "wave": wave, "step": (wave + 1) * nms[vw], "time": t,
                 "train_loss": losses, "global_clock": clock})  # device scalars, resolved at the end
    if clock > state["clock"]:
      state["clock"] = clock
      if clock % config.eval_every == 0 or clock == config.waves:
        snapshots.append((len(rows) - 1, ps.params))
        logging.info("global clock %d/%d  t=%.4gs  VW %d wave %d loss %.4f  (%d/%d waves pushed)",
                     clock, config.waves, t, vw, wave, float(np.mean(jax.device_get(losses))),
                     state["waves"], total_waves)

  engine = Engine(vws, ps, trace, batches, on_wave)
  x0, y0 = batches(0, 1)
  for vw in vws:  # compile before the clock starts
    vw.warm_up(x0, y0)
  ps.warm_up()
  t_host = time.perf_counter()
  try:
    if config.executor == "virtual":
      seconds = executors.run_virtual(engine, cost)
    else:
      seconds = executors.run_wall(engine, cost if config.time_scale > 0 else None, config.time_scale)
    final = ps.params
    jax.block_until_ready(final)
  finally:
    trace.close()
  wall_seconds = time.perf_counter() - t_host

  if not snapshots or snapshots[-1][0] != len(rows) - 1:
    snapshots.append((len(rows) - 1, final))
  evaluate = make_evaluator(model, dataset, devices[0])
  for row_index, params in snapshots:
    rows[row_index]["test_accuracy"] = evaluate(params)
  for row, losses in zip(rows, jax.device_get([row["train_loss"] for row in rows])):
    row["train_loss"] = float(np.mean(losses))
  images = sum(vw.completed for vw in vws) * config.batch_size
  return RunResult(init_params, final, trace.events, rows, seconds, wall_seconds, vws, cuts, images)


def _meta(config: RunConfig, cluster: Cluster, model_name: str, dataset_name: str, num_units: int,
          layout: Layout) -> dict[str, Any]:
  """The trace's meta line of a run."""
  shape = layout.meta()
  return dict(ev="meta", version=1, num_vws=shape["num_vws"], nm=shape["nm"], d=config.d,
              stages=shape["stages"], weight_mode=config.weight_mode, executor=config.executor,
              schedule=config.schedule, shards=num_units, model=model_name, dataset=dataset_name,
              batch_size=config.batch_size, cuts=shape["cuts"], gpus=shape["gpus"], cluster=cluster.name,
              seed=config.seed, policy=config.policy, placement=config.placement,
              time_model=config.time_model)


def _simulate(config: RunConfig, cluster: Cluster, model_name: str, dataset_name: str, profiles,
              layout: Layout) -> RunResult:
  """The ``sim`` executor: the same engine on the cost model with link contention, no numerics."""
  trace = Trace(config.trace_path)
  t_host = time.perf_counter()
  try:
    seconds, vws, rows = simulate(cluster, profiles, layout, config.d, config.waves, trace,
                                  config.placement, config.schedule, config.weight_mode,
                                  meta=_meta(config, cluster, model_name, dataset_name, len(profiles), layout))
  finally:
    trace.close()
  images = sum(vw.completed for vw in vws) * config.batch_size
  return RunResult(None, None, trace.events, rows, seconds, time.perf_counter() - t_host, vws, layout.cuts,
                   images)


def make_evaluator(model: LayeredModel, dataset: Dataset, device: jax.Device, chunk: int = 2000):
  """Returns ``params -> test accuracy`` of the whole model on ``dataset``'s test split."""
  predict = jax.jit(lambda params, x: jnp.argmax(model.apply(params, x), axis=-1))
  xs = [jax.device_put(dataset.x_test[i:i + chunk], device) for i in range(0, len(dataset.x_test), chunk)]

  def evaluate(params) -> float:
    params = jax.device_put(params, device)
    pred = np.concatenate([np.asarray(predict(params, x)) for x in xs])
    return float((pred == dataset.y_test).mean())

  return evaluate
