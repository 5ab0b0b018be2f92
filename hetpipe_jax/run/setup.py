"""A run laid out: the one builder every executor takes its parts from.

:func:`prepare` turns a model, its data (or a full-size input description) and a validated
:class:`~hetpipe_jax.run.config.RunConfig` into a :class:`Setup`: the cluster, the per-unit profiles of
the trained model and of the clock's model, the two layouts, the cost context, the local optimizer and
what the trace's meta line records of the run (built here, once, for every executor). A :class:`Setup`
then builds what the executors share: minibatch streams, initial weights, virtual workers, task costs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hetpipe_jax.cluster import Cluster, get_cluster
from hetpipe_jax.core.meta import meta_event
from hetpipe_jax.core.worker import VirtualWorker, virtual_workers
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import optimizer_slots_of
from hetpipe_jax.cost.profile import UnitProfile, full_size_profiles, profile_units
from hetpipe_jax.data import Dataset, MinibatchStreams, check_batch_size
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE, FullSize, get_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.models.custom import check_data
from hetpipe_jax.models.nnx_unit import NnxUnit
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.plan.costmodel import CostModel
from hetpipe_jax.plan.layout import Layout, per_vw
from hetpipe_jax.plan.manual import fastest_cuts, grouped_layout, manual_layout
from hetpipe_jax.run.config import LayoutSpec, RunConfig


@dataclasses.dataclass(frozen=True)
class Setup:
  """A validated run with its layout (see the module docstring).

  Attributes:
    config: the run's configuration.
    model / dataset: what is trained, on what (a :class:`FullSize` input for the ``sim`` executor).
    cluster: the emulated cluster.
    profiles / clock_profiles: per-unit costs of the trained model and of the model whose durations the
      clock takes (the same unless ``layout.time_model``).
    layout / clock_layout: the layout the numerics run on and the one the clock times (likewise).
    costs: what a stage's cost and memory depend on (weight mode, optimizer slots, precision).
    tx: the stages' local optimizer (its state's size; each virtual worker's, with its schedule: :meth:`vw_tx`).
    fields: what the trace's meta line records beyond the protocol (:func:`run_fields`).
    sample_x: one minibatch of inputs (or its shape).
  """

  config: RunConfig
  model: LayeredModel
  dataset: Dataset | FullSize
  cluster: Cluster
  profiles: Sequence[UnitProfile]
  clock_profiles: Sequence[UnitProfile]
  layout: Layout
  clock_layout: Layout
  costs: CostContext
  tx: optax.GradientTransformation
  fields: dict[str, Any]
  sample_x: Any

  @property
  def data(self) -> Dataset:
    """The training data (executors with numerics; :func:`prepare` refused a shape-only input for them)."""
    assert isinstance(self.dataset, Dataset)
    return self.dataset

  def vw_tx(self, i: int) -> optax.GradientTransformation:
    """Virtual worker ``i``'s local optimizer: ``tx``, or under a learning-rate schedule one over its stages' local
    updates of the run (waves x Nm minibatches, one update per K of them under a staleness control that
    accumulates K)."""
    c = self.config
    if c.optim.schedule.constant:
      return self.tx
    nm = self.layout.vws[i].nm
    return c.optim.local(c.waves * nm // c.wsp.control.accumulate(nm))

  def streams(self) -> MinibatchStreams:
    """Every virtual worker's minibatch stream."""
    c = self.config
    return MinibatchStreams(self.data, c.batch_size, self.layout.num_vws, c.seed, c.drop_remainder)

  def init_params(self) -> tuple[Any, ...]:
    """The initial weights, one pytree per unit (the same in every process of a run)."""
    return self.model.init(jax.random.key(self.config.seed), self.sample_x)

  def virtual_workers(self, numerics: Sequence[Any] | None = None) -> list[VirtualWorker]:
    """The virtual workers of the layout (schedule, weight mode, waves, window), with ``numerics`` (one
    per virtual worker; None: schedule only)."""
    c = self.config
    return virtual_workers(self.layout.vws, c.waves, c.wsp.schedule, c.wsp.weight_mode, numerics, c.wsp.control)

  def meta_line(self) -> dict[str, Any]:
    """The trace's meta line of a run with numerics (the ``sim`` executor writes its own, with ``fields``)."""
    wsp = self.config.wsp
    return meta_event(self.layout.meta(), wsp.d, wsp.weight_mode, wsp.schedule, self.config.executor,
                      self.model.num_units, self.config.trace_version, wsp.control, **self.fields)

  @functools.cached_property
  def task_cost(self):
    """Task -> emulated seconds on the clock's model and layout (its cost model built once per run)."""
    model = CostModel(self.cluster, self.clock_profiles, self.clock_layout)
    return lambda task: model.task_seconds(task.vw, task.stage, task.kind)


def _inputs(dataset: Dataset | FullSize, config: RunConfig) -> tuple[Any, str]:
  """(one minibatch of inputs or its shape, the dataset's name for the meta line)."""
  if isinstance(dataset, FullSize):
    sample = jax.ShapeDtypeStruct((config.batch_size, *dataset.input_shape), jnp.dtype(dataset.dtype))
    return sample, f"none (input {'x'.join(map(str, dataset.input_shape))}, {dataset.num_classes} classes)"
  check_batch_size(dataset, config.batch_size, config.drop_remainder)
  return jnp.asarray(dataset.x_train[:config.batch_size]), dataset.name


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


def _planned(spec: LayoutSpec, cluster: Cluster, profiles, costs: CostContext) -> Layout:
  """The layout a policy gives: a grouping with cuts as given, else the allocation and the partitioner."""
  if spec.cuts is not None:
    assert spec.policy is not None and not isinstance(spec.policy, str) and not isinstance(spec.nm, str)
    return grouped_layout(cluster, profiles, spec.policy, spec.cuts, spec.nm, costs, spec.window, int(spec.tp))
  nm = spec.nm if isinstance(spec.nm, (str, int)) else list(spec.nm)
  assert spec.policy is not None
  return plan_cluster(cluster, profiles, spec.policy, spec.placement,
                      nm[0] if isinstance(nm, list) and len(nm) == 1 else nm, None, costs, spec.tp).layout


def layouts(spec: LayoutSpec, model: LayeredModel, cluster: Cluster, profiles, clock_profiles,
            costs: CostContext) -> tuple[Layout, Layout]:
  """(the layout the numerics run on, the layout the clock times), both with ``spec.window``: the same
  unless ``time_model`` asks the clock for a larger model's cuts on the same GPUs.

  With a policy, the allocation and the partitioner lay out the clock's model, and the numerics take the
  fastest cuts on the same GPUs; else ``num_vws``, ``stages``, ``nm`` and ``cuts`` lay out the numerics'
  model, and the clock takes the fastest cuts of its own.
  """
  if spec.policy is not None:
    clock = _planned(spec, cluster, clock_profiles, costs)
    layout = (clock if spec.time_model is None
              else fastest_cuts(cluster, profiles, clock.gpus, clock.nms, costs).with_windows(clock.windows))
  else:
    layout = manual_layout(cluster, profiles, per_vw("stages", spec.stages, spec.num_vws), spec.nm, spec.cuts, costs,
                           model.name, int(spec.tp))
    clock = layout if spec.time_model is None else fastest_cuts(cluster, clock_profiles, layout.gpus, layout.nms,
                                                               costs)
  return layout.with_windows(spec.window), clock.with_windows(spec.window)


def run_fields(config: RunConfig, cluster: Cluster, model_name: str, data_name: str) -> dict[str, Any]:
  """What the trace's meta line records of a run beyond the protocol (:func:`hetpipe_jax.core.meta.meta_event`
  writes those; the ``sim`` executor adds its options, :func:`hetpipe_jax.sim.simulate.meta_line`)."""
  spec = config.layout
  return dict(model=model_name, dataset=data_name, batch_size=config.batch_size, cluster=cluster.name,
              seed=config.seed, policy=spec.policy, placement=spec.placement, time_model=spec.time_model,
              **({"precision": config.precision} if config.precision != "fp32" else {}),
              **({"ps_optimizer": config.optim.ps_spec} if config.optim.ps_spec != "add" else {}),
              **({} if config.optim.schedule.constant else {"lr_schedule": str(config.optim.schedule)}),
              **({"slow": [list(s) for s in config.faults.slow]} if config.faults.slow else {}))


def check_seed_reaches(model: LayeredModel, seed: int) -> None:
  """Raises ConfigError when ``seed`` (other than 0) cannot reach a unit: an NNX module given built keeps the
  parameters it holds (:mod:`hetpipe_jax.models.nnx_unit`)."""
  fixed = [name for name, unit in zip(model.unit_names, model.units) if isinstance(unit, NnxUnit) and not unit.seeded]
  if fixed and seed != 0:
    raise ConfigError(f"seed={seed} cannot reach unit(s) {', '.join(fixed)} of model {model.name!r}: an NNX module "
                      "given built keeps the parameters it holds; give it as a function of rngs (e.g. lambda rngs: "
                      "nnx.Linear(64, 10, rngs=rngs)) to initialise it from the seed, or run with seed 0")


def prepare(model: LayeredModel, dataset: Dataset | FullSize, config: RunConfig) -> Setup:
  """Profiles ``model``, lays out the run and builds its meta line (``config`` validated already).

  Raises:
    ConfigError: for a model that cannot take the data, a seed that cannot reach its units, a layout that
      cannot run, or a failure of a virtual worker the layout does not have.
  """
  check_seed_reaches(model, config.seed)
  sample_x, data_name = _inputs(dataset, config)
  cluster = get_cluster(config.cluster) if isinstance(config.cluster, str) else config.cluster
  tx = config.optim.local()
  param_shapes = _param_shapes(model, sample_x, data_name)
  if isinstance(dataset, Dataset):
    check_data(model, param_shapes, sample_x, dataset.y_train[:config.batch_size], dataset.num_classes, data_name)
  profiles = profile_units(model, sample_x)
  costs = CostContext(config.wsp.weight_mode, optimizer_slots_of(tx, param_shapes), config.precision,
                      config.layout.recompute, control=config.wsp.control)
  time_model = config.layout.time_model
  clock_profiles = profiles if time_model is None else full_size_profiles(time_model, config.batch_size)
  layout, clock_layout = layouts(config.layout, model, cluster, profiles, clock_profiles, costs)
  config.faults.check_vws(layout.num_vws)
  config.wsp.control.check_nm(list(layout.nms))
  return Setup(config, model, dataset, cluster, profiles, clock_profiles, layout, clock_layout, costs, tx,
               run_fields(config, cluster, model.name, data_name), sample_x)
