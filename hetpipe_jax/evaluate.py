"""Test accuracy and test loss of a model's weights: shared by HetPipe runs and the peers' numerics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.data import Dataset
from hetpipe_jax.models.base import LayeredModel


def make_evaluator(model: LayeredModel, dataset: Dataset, device: Any,
                   chunk: int = 2000) -> Callable[[Any], dict[str, float]]:
  """An evaluator of the whole model on ``dataset``'s test split.

  Args:
    model: the model.
    dataset: its test split is evaluated (moved to ``device`` once, in chunks).
    device: where the evaluation runs (a ``jax.Device``).
    chunk: examples per jitted prediction.

  Returns:
    ``params -> {"test_accuracy": a fraction in [0, 1], "test_loss": the model's mean loss per label}`` (its
    default, cross-entropy; a language model: per token, its perplexity ``exp`` of it).
  """

  def predict(params, x, y):
    logits = model.apply(params, x)
    return jnp.argmax(logits, axis=-1), model.loss(logits, y) * y.size

  predict = jax.jit(predict)
  parts = [(jax.device_put(dataset.x_test[i:i + chunk], device), jax.device_put(dataset.y_test[i:i + chunk], device))
           for i in range(0, len(dataset.x_test), chunk)]

  def evaluate(params) -> dict[str, float]:
    params = jax.device_put(params, device)
    outs = [predict(params, x, y) for x, y in parts]
    pred = np.concatenate([np.asarray(p) for p, _ in outs])
    loss = sum(float(s) for _, s in outs) / dataset.y_test.size
    return {"test_accuracy": float((pred == dataset.y_test).mean()), "test_loss": loss}

  return evaluate


def unigram_loss(dataset: Dataset) -> float:
  """The test loss of a model that ignores its input: the mean cross-entropy per test label (nats) of the
  training labels' frequencies, add-one smoothed over the ``num_classes`` classes (a language model's
  unigram baseline; its perplexity is ``exp`` of it).

  Example:
    >>> from hetpipe_jax.data import Dataset
    >>> y = np.array([[0, 0, 0, 1]])
    >>> round(unigram_loss(Dataset("d", y, y, y, y, 2)), 4)  # p(0) = 4/6, p(1) = 2/6
    0.5788
  """
  counts = np.bincount(dataset.y_train.ravel(), minlength=dataset.num_classes) + 1.0
  log_p = np.log(counts / counts.sum())
  return float(-log_p[dataset.y_test.ravel()].mean())
