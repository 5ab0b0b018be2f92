"""Test accuracy of a model's weights: shared by HetPipe runs and the data-parallel baseline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.data import Dataset
from hetpipe_jax.models.base import LayeredModel


def make_evaluator(model: LayeredModel, dataset: Dataset, device: Any,
                   chunk: int = 2000) -> Callable[[Any], float]:
  """An evaluator of the whole model on ``dataset``'s test split.

  Args:
    model: the model.
    dataset: its test split is evaluated (moved to ``device`` once, in chunks).
    device: where the evaluation runs (a ``jax.Device``).
    chunk: examples per jitted prediction.

  Returns:
    ``params -> test accuracy`` (a fraction in [0, 1]).
  """
  predict = jax.jit(lambda params, x: jnp.argmax(model.apply(params, x), axis=-1))
  xs = [jax.device_put(dataset.x_test[i:i + chunk], device) for i in range(0, len(dataset.x_test), chunk)]

  def evaluate(params) -> float:
    params = jax.device_put(params, device)
    pred = np.concatenate([np.asarray(predict(params, x)) for x in xs])
    return float((pred == dataset.y_test).mean())

  return evaluate
