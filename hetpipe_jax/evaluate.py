"""Test accuracy and test loss of a model's weights: shared by HetPipe runs and the peers' numerics; what a
language model reports instead (:class:`LanguageScore`: tokens, perplexity, the unigram baseline)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.data import BYTE_DATASETS, Dataset
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.models.zoo import FullSize


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


class LanguageScore(NamedTuple):
  """What a language model's run reports: tokens (not images) and perplexity (not accuracy).

  Attributes:
    unit: what a token is: ``bytes`` (the text dataset's) or ``tokens``.
    tokens_per_example: the tokens of one sequence (its labels: the next tokens).
    test_loss: the final test loss per token (nats); None without numerics (the sim executor).
    unigram_loss: the unigram baseline's test loss per token (:func:`unigram_loss`); None without data.
  """

  unit: str
  tokens_per_example: int
  test_loss: float | None
  unigram_loss: float | None

  @property
  def perplexity(self) -> float | None:
    """The final test perplexity, ``exp`` of the loss per token."""
    return None if self.test_loss is None else math.exp(self.test_loss)

  @property
  def unigram_perplexity(self) -> float | None:
    return None if self.unigram_loss is None else math.exp(self.unigram_loss)


def language_score(dataset: Dataset | FullSize, test_loss: float | None) -> LanguageScore | None:
  """A language model's score (labels: the next token of each position; a full-size GPT's input: a sequence of
  integer tokens), its final test loss ``test_loss``; None for any other model.

  Example:
    >>> from hetpipe_jax.data import Dataset
    >>> y = np.array([[0, 0, 0, 1]])
    >>> score = language_score(Dataset("text", y, y, y, y, 2), 0.5)
    >>> score.unit, score.tokens_per_example, round(score.perplexity, 4), round(score.unigram_perplexity, 4)
    ('bytes', 4, 1.6487, 1.7838)
  """
  if isinstance(dataset, Dataset):
    if dataset.y_train.ndim != 2:
      return None
    unit = "bytes" if dataset.name in BYTE_DATASETS else "tokens"
    return LanguageScore(unit, dataset.y_train.shape[1], test_loss, unigram_loss(dataset))
  if len(dataset.input_shape) == 1 and np.issubdtype(np.dtype(dataset.dtype), np.integer):
    return LanguageScore("tokens", dataset.input_shape[0], None, None)
  return None
