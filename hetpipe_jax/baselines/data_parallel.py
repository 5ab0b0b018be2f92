"""Horovod-style synchronous data parallelism, numerically: the convergence baseline (docs/PROTOCOL.md section 6).

Every step each of N workers computes the gradient of its own minibatch; the gradients are averaged
(the all-reduce) and one update is applied to the one copy of the weights. The clock advances by the
cost model's iteration time (:func:`hetpipe_jax.baselines.horovod.horovod_iteration_seconds`) per step.
Each worker's gradient is computed on its own minibatch (one jitted call each: on CPU, twelve batches of
32 take 0.5 s where one batch of 384 takes 0.83 s), then averaged and applied in one jitted update.
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

  grad = jax.jit(jax.value_and_grad(loss_fn))

  @jax.jit
  def update(params, opt_state, results):
    # the all-reduce: the average of the workers' losses and gradients
    loss = sum(r[0] for r in results) / len(results)
    grads = jax.tree.map(lambda *g: sum(g) / len(g), *(r[1] for r in results))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = make_evaluator(model, dataset, device)
  rows, losses = [], []
  for s in range(1, steps + 1):
    results = [grad(params, *(jax.device_put(np.asarray(a), device) for a in streams(w, s)))
               for w in range(num_workers)]
    params, opt_state, loss = update(params, opt_state, results)
    losses.append(loss)
    rows.append({"vw": 0, "wave": s - 1, "step": s, "time": s * step_seconds})
    if s % eval_every == 0 or s == steps:
      rows[-1]["test_accuracy"] = evaluate(params)
      logging.info("data parallel (%d workers): step %d/%d  t=%.4gs  test accuracy %.4f", num_workers, s,
                   steps, rows[-1]["time"], rows[-1]["test_accuracy"])
  for row, loss in zip(rows, jax.device_get(losses)):
    row["train_loss"] = float(loss)
  return rows
