"""Build and run HetPipe: virtual workers on an emulated cluster, a parameter server, an executor.

Example::

  from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe
  result = run_hetpipe(get_model("cnn"), load_dataset("digits"),
                       RunConfig.of(num_vws=2, stages=(2, 2), nm=(2, 2), d=1, waves=20))
  result.metrics[-1]["test_accuracy"]

A run is a short pipeline (:mod:`hetpipe_jax.run`): validate the config -> the executor's entry checks
what it runs -> profile and lay out (:func:`~hetpipe_jax.run.setup.prepare`) -> the executor builds and
runs it -> the result. Every bad configuration raises :class:`ConfigError` before anything runs.
"""

from __future__ import annotations

import jax

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FullSize
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors import get_executor
from hetpipe_jax.run.result import RunResult
from hetpipe_jax.run.setup import prepare

__all__ = ["RunConfig", "RunResult", "run_hetpipe"]


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
  config.validate()
  executor = get_executor(config.executor)
  executor.validate(config)
  if dataset is None:
    dataset = _input_only(model)
  if isinstance(dataset, FullSize) and executor.numerics:
    raise ConfigError(f"executor={config.executor!r} trains on data, but the run has only an input shape "
                      f"{dataset.input_shape}; give a dataset, or simulate (executor='sim')")
  return executor.run(prepare(model, dataset, config))
