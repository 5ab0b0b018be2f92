"""Build and run HetPipe: virtual workers on an emulated cluster, a parameter server, an executor.

Example::

  from hetpipe_jax import RunConfig, get_model, load_dataset, plan_hetpipe, plan_table, run_hetpipe
  config = RunConfig.of(num_vws=2, stages=(2, 2), nm=(2, 2), d=1, waves=20)
  print(plan_table(plan_hetpipe(get_model("cnn"), load_dataset("digits"), config)))   # before running it
  result = run_hetpipe(get_model("cnn"), load_dataset("digits"), config)
  result.metrics[-1]["test_accuracy"]

A run is a short pipeline (:mod:`hetpipe_jax.run`): validate the config -> the executor's entry checks
what it runs -> profile and lay out (:func:`~hetpipe_jax.run.setup.prepare`) -> the executor builds and
runs it -> the result. Every bad configuration raises :class:`ConfigError` before anything runs.
:func:`plan_hetpipe` stops after the layout and returns the plan to read before running it.
"""

from __future__ import annotations

from typing import Any

import jax

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FullSize
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.plan.allocation import layout_plan
from hetpipe_jax.plan.plan_json import plan_table, plan_to_json
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors import get_executor
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.setup import Setup, prepare
from hetpipe_jax.sim.planned import simulate_plan

__all__ = ["RunConfig", "RunResult", "plan_hetpipe", "plan_table", "run_hetpipe"]


def _setup(model: LayeredModel, dataset, config: RunConfig) -> Setup:
  """Validates ``config`` (its own fields, then what its executor runs) and lays the run out."""
  config.validate()
  executor = get_executor(config.executor)
  executor.validate(config)
  if dataset is None:
    dataset = _input_only(model)
  if isinstance(dataset, FullSize) and executor.numerics:
    raise ConfigError(f"executor={config.executor!r} trains on data, but the run has only an input shape "
                      f"{dataset.input_shape}; give a dataset, or simulate (executor='sim')")
  return prepare(model, dataset, config)


def _input_only(model: LayeredModel) -> FullSize:
  """A model's own input description (no data), from its input spec."""
  if model.input_spec is None:
    raise ConfigError(f"no dataset for model {model.name!r}, which has no input spec; give a dataset, or a model "
                      "built with input_shape (from_modules / from_module)")
  out = jax.eval_shape(model.apply, jax.eval_shape(model.init, jax.random.key(0), model.sample_input(1)),
                       model.sample_input(1))
  return FullSize(model.input_spec.shape, out.shape[-1], model.input_spec.dtype)


def run_hetpipe(model: LayeredModel, dataset, config: RunConfig) -> RunResult:
  """Trains ``model`` on ``dataset`` with N virtual workers under WSP; see :class:`RunConfig`.

  ``dataset`` may be a :class:`~hetpipe_jax.models.FullSize` input description instead (the ``sim``
  executor runs no numerics, so it needs no data: e.g. VGG-19 at its 224x224 ImageNet input, or a GPT
  at a sequence length, :func:`~hetpipe_jax.models.full_size_spec`), or None for a model that carries its
  input's shape (:func:`~hetpipe_jax.models.from_modules`).

  Raises:
    ConfigError: for a configuration that cannot run, before anything runs.
  """
  return get_executor(config.executor).run(_setup(model, dataset, config))


def plan_hetpipe(model: LayeredModel, dataset, config: RunConfig, *, simulate: bool = True) -> dict[str, Any]:
  """The plan of the run ``run_hetpipe(model, dataset, config)`` would run, without running it.

  The same layout the run gets (the planner's with ``config.layout.policy``, else the given stages and
  cuts), evaluated by the cost model: per virtual worker its GPUs in pipeline order, Nm, each stage's
  units, modelled time per minibatch and memory against its GPU's, the bottleneck and modelled images/s,
  and the PS traffic a push sends across nodes; the node of every PS shard; per unit its costs on every GPU
  type. Its ``images_per_s`` is what the ``sim`` executor measures of the layout (in fast mode, at the
  config's D; ``bound_images_per_s`` is the planner's own sum of the virtual workers' rates, a bound), unless
  ``simulate`` is False (then ``images_per_s`` is the bound, labelled so). With ``time_model`` the plan is
  of the clock's model (the one the layout was planned for). The document is JSON-serialisable, the same
  that ``python -m experiments.plan`` writes; :func:`plan_table` prints it.

  ``dataset`` may be a :class:`~hetpipe_jax.models.FullSize` input description with the ``sim`` executor,
  as for :func:`run_hetpipe`.

  Raises:
    ConfigError: for what :func:`run_hetpipe` would refuse (a policy whose virtual workers no partition
      fits in memory included), before anything runs.
  """
  setup = _setup(model, dataset, config)
  spec = config.layout
  policy = "manual" if spec.policy is None else spec.policy if isinstance(spec.policy, str) else "custom"
  plan = layout_plan(setup.cluster, setup.clock_profiles, setup.clock_layout, policy, spec.placement, setup.costs)
  simulated = simulate_plan(setup.cluster, setup.clock_profiles, plan, config.batch_size, d=config.wsp.d,
                            weight_mode=config.wsp.weight_mode, schedule=config.wsp.schedule,
                            precision=config.precision).to_json() if simulate else None
  return plan_to_json(setup.cluster, setup.clock_profiles, plan, spec.time_model or model.name, config.batch_size,
                      config.precision, simulated)
