"""Horovod-style synchronous data parallelism, numerically: the convergence baseline (HETPIPE.md section 6).

Every step each of N workers computes the gradient of its own minibatch; the gradients are averaged
(the all-reduce) and one update is applied to the one copy of the weights. The clock advances by the
cost model's iteration time (:func:`hetpipe_jax.baselines.horovod.horovod_iteration_seconds`) per step.
One jitted step per iteration: the average of equal-size minibatches' gradients is the gradient of the
mean loss over their union, computed as one batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from hetpipe_jax.data import Dataset, MinibatchStreams
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.models.base import LayeredModel, cross_entropy


def train_data_parallel(model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        num_workers: int, steps: int, batch_size: int, step_seconds: float, seed: int = 0,
                        eval_every: int = 10, device: Any = None) -> list[dict[str, Any]]:
  """Trains ``model`` by synchronous data parallelism over ``num_workers`` workers.

  Args:
    model: the model.
    dataset: training and test data.
    tx: the optimizer, applied to the averaged gradient.
    num_workers: workers, each with its own minibatch stream.
    steps: synchronous steps.
    batch_size: examples per worker's minibatch.
    step_seconds: modelled seconds of one step (the clock of the metrics).
    seed: initialisation and shuffling seed.
    eval_every: evaluate the test accuracy every this many steps (and at the end).
    device: where it runs, a ``jax.Device`` (default: the first JAX device).

  Returns:
    Metrics rows like the HetPipe runs': ``{"vw": 0, "wave": step-1, "step", "time", "train_loss"}`` per
    step, with ``test_accuracy`` every ``eval_every`` steps and at the end.
  """
  device = device or jax.devices()[0]
  streams = MinibatchStreams(dataset, batch_size, num_workers, seed)
  params = jax.device_put(model.init(jax.random.key(seed), jnp.asarray(dataset.x_train[:batch_size])), device)
  opt_state = tx.init(params)
  loss_fn = lambda p, x, y: cross_entropy(model.apply(p, x), y)

  @jax.jit
  def step(params, opt_state, xs, ys):
    # The average of the workers' gradients (the all-reduce) is the gradient of the mean loss over
    # their minibatches together (all have the same size), computed here as one batch.
    loss, grads = jax.value_and_grad(loss_fn)(params, xs.reshape((-1,) + xs.shape[2:]), ys.reshape(-1))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = make_evaluator(model, dataset, device)
  rows, losses = [], []
  for s in range(1, steps + 1):
    batch = [streams(w, s) for w in range(num_workers)]
    xs = jax.device_put(np.stack([b[0] for b in batch]), device)
    ys = jax.device_put(np.stack([b[1] for b in batch]), device)
    params, opt_state, loss = step(params, opt_state, xs, ys)
    losses.append(loss)
    rows.append({"vw": 0, "wave": s - 1, "step": s, "time": s * step_seconds})
    if s % eval_every == 0 or s == steps:
      rows[-1]["test_accuracy"] = evaluate(params)
      logging.info("data parallel (%d workers): step %d/%d  t=%.4gs  test accuracy %.4f", num_workers, s,
                   steps, rows[-1]["time"], rows[-1]["test_accuracy"])
  for row, loss in zip(rows, jax.device_get(losses)):
    row["train_loss"] = float(loss)
  return rows
