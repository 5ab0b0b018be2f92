"""Horovod-style synchronous data parallelism, numerically: the convergence baseline (docs/PROTOCOL.md section 6).

Every step each of N workers computes the gradient of its own minibatch; the gradients are averaged
(the all-reduce) and one update is applied to the one copy of the weights. The clock advances by the
cost model's iteration time (:func:`hetpipe_jax.baselines.horovod.horovod_iteration_seconds`) per step.
It is :func:`hetpipe_jax.baselines.numerics.train_weighted_sync` with equal batch sizes: each worker's
gradient is computed on its own minibatch (one jitted call each: on CPU, twelve batches of 32 take 0.5 s
where one batch of 384 takes 0.83 s), then averaged and applied in one jitted update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from hetpipe_jax.baselines.numerics import train_weighted_sync
from hetpipe_jax.data import Dataset, check_batch_size
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel


def train_data_parallel(model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        num_workers: int, steps: int, batch_size: int, step_seconds: float, seed: int = 0,
                        eval_every: int = 10, device: Any = None) -> list[dict[str, Any]]:
  """Trains ``model`` by synchronous data parallelism over ``num_workers`` workers.

  Args:
    model: the model.
    dataset: training and test data.
    tx: the optimizer, applied to the averaged gradient.
    num_workers: workers, each with its own minibatch stream (those of
      ``MinibatchStreams(dataset, batch_size, num_workers, seed)``).
    steps: synchronous steps.
    batch_size: examples per worker's minibatch; must divide the training set.
    step_seconds: modelled seconds of one step (the clock of the metrics).
    seed: initialisation and shuffling seed.
    eval_every: evaluate the test accuracy every this many steps (and at the end).
    device: where it runs, a ``jax.Device`` (default: the first JAX device).

  Returns:
    Metrics rows like the HetPipe runs': ``{"vw": 0, "wave": step-1, "step", "time", "train_loss", "examples"}``
    per step, with ``test_accuracy`` every ``eval_every`` steps and at the end.

  Raises:
    ConfigError: for fewer than 1 worker or a batch size that does not divide the training set.
    RunStopped: when a step's loss or the weights are not finite (the run diverged).
  """
  check_batch_size(dataset, batch_size)
  if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
    raise ConfigError(f"num_workers={num_workers!r}; data parallelism needs an integer >= 1 of workers")
  return train_weighted_sync(model, dataset, tx, [batch_size] * num_workers, steps, step_seconds, seed, eval_every,
                             device, what=f"data parallel ({num_workers} workers)")
