"""Horovod-style synchronous data parallelism, numerically: the convergence baseline (docs/PROTOCOL.md section 6).

Every step each of N workers computes the gradient of its own minibatch; the gradients are averaged
(the all-reduce) and one update is applied to the one copy of the weights. The clock advances by the
cost model's iteration time (:func:`hetpipe_jax.baselines.horovod.horovod_iteration_seconds`) per step.
It is :func:`hetpipe_jax.baselines.numerics.train_sgd` with equal batch sizes: each worker's
gradient is computed on its own minibatch (one jitted call each: on CPU, twelve batches of 32 take 0.5 s
where one batch of 384 takes 0.83 s), then averaged and applied in one jitted update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from hetpipe_jax.baselines.numerics import TrainResult, train_sgd
from hetpipe_jax.data import Dataset, check_batch_size
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel


def train_data_parallel(*, model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        num_workers: int, batch_size: int, steps: int, step_seconds: float,
                        **options: Any) -> TrainResult:
  """Trains ``model`` by synchronous data parallelism over ``num_workers`` workers.

  Args:
    model: the model.
    dataset: training and test data.
    tx: the optimizer, applied to the averaged gradient.
    num_workers: workers, each with its own minibatch stream (those of
      ``MinibatchStreams(dataset, batch_size, num_workers, seed)``).
    batch_size: examples per worker's minibatch; must divide the training set.
    steps: synchronous steps.
    step_seconds: modelled seconds of one step (the clock of the metrics).
    **options: :func:`~hetpipe_jax.baselines.numerics.train_sgd`'s ``seed``, ``eval_every``, ``device``.

  Returns:
    The rows (like the HetPipe runs' metrics, one per step) and the final weights.

  Raises:
    ConfigError: for fewer than 1 worker or a batch size that does not divide the training set.
    RunStopped: when a step's loss or the weights are not finite (the run diverged).
  """
  check_batch_size(dataset, batch_size)
  if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
    raise ConfigError(f"num_workers={num_workers!r}; data parallelism needs an integer >= 1 of workers")
  return train_sgd(model=model, dataset=dataset, tx=tx, batch_sizes=[batch_size] * num_workers, rounds=steps,
                   round_seconds=step_seconds, what=f"data parallel ({num_workers} workers)", **options)
