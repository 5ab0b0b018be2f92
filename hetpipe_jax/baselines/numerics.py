"""The numerics of the synchronous and local-SGD peers of HetPipe, for the convergence study.

* :func:`train_weighted_sync`: synchronous SGD where worker i computes the gradient of its own minibatch of
  ``batch_sizes[i]`` examples and the gradients are combined weighted by each worker's share b_i / sum(b):
  the gradient of one batch of sum(b) examples, one optimizer update per step. It is the numerics of
  heterogeneity-aware data parallelism (``hetero_dp``: a GPU's share of the global batch, computed at once or
  by gradient accumulation, which is numerically the same), of synchronous heterogeneous pipelines
  (``sync_pipeline``: a pipeline's microbatches x batch) and, with equal sizes, of Horovod
  (:func:`hetpipe_jax.baselines.data_parallel.train_data_parallel` calls it).
* :func:`train_local_sgd`: local SGD with an outer optimizer (DiLoCo, arXiv 2311.08105; a number of local
  steps per worker as in asynchronous local SGD, arXiv 2401.09135). Every round each worker starts from the
  global weights, takes its H_i steps of the inner optimizer (whose state it keeps across rounds), and the
  weight changes, averaged weighted by the examples each worker processed, are the negated outer gradient
  of an SGD (Nesterov) momentum step.

Each worker reads its own stream (:class:`hetpipe_jax.data.WorkerStreams`): every example is seen once per
epoch across the workers. The clock is the modelled seconds of one step or round, given by the caller (the
timing side). Each worker's gradient or inner step is one jitted call (one compilation per distinct batch
size); the combine and update are one more, summing the workers in their order (deterministic). A
non-finite training loss or weights stop the run (:class:`~hetpipe_jax.errors.RunStopped`, naming the step),
checked at every evaluation with one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from hetpipe_jax.data import Dataset, WorkerStreams
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.runtime.mixed import all_finite

Rows = list[dict[str, Any]]


def _weighted_mean(values: Sequence[Any], weights: Sequence[int]) -> Any:
  """The mean of ``values`` (arrays) weighted by ``weights`` (positive ints), summed in order.

  With equal weights it is the plain mean ``sum(values) / len(values)``, the same expression (and so the same
  bits) as Horovod's average; else ``sum(w_i x v_i) / sum(w)``."""
  if len(set(weights)) == 1:
    return sum(values) / len(values)
  return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def _tree_weighted_mean(trees: Sequence[Any], weights: Sequence[int]) -> Any:
  return jax.tree.map(lambda *leaves: _weighted_mean(leaves, weights), *trees)


_all_finite = jax.jit(all_finite)


def _check_count(name: str, value: Any, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ConfigError(f"{name}={value!r}; it must be an integer >= {low}")
  return int(value)


def _check_seconds(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
      math.isfinite(value) and value >= 0):
    raise ConfigError(f"{name}={value!r}; it must be a finite number of seconds >= 0 (the modelled time of one "
                      "step or round)")
  return float(value)


class _Tracker:
  """The metrics rows of a run, the test evaluations, and the check that its losses and weights are finite."""

  def __init__(self, model: LayeredModel, dataset: Dataset, device: Any, what: str, unit: str, total: int,
               eval_every: int, seconds: float, hint: str):
    self.evaluate = make_evaluator(model, dataset, device)
    self.what, self.unit, self.total, self.eval_every, self.seconds, self.hint = (what, unit, total, eval_every,
                                                                                  seconds, hint)
    self.rows: Rows = []
    self.examples: list[int] = []
    self.losses: list[Any] = []  # on the device until checked
    self.fetched: list[float] = []

  def record(self, s: int, params: Any, loss: Any, examples: int) -> None:
    """Step or round ``s`` (from 1) ended with ``params``, its mean training loss ``loss`` (on the device), and
    ``examples`` seen so far."""
    self.losses.append(loss)
    self.examples.append(examples)
    self.rows.append({"vw": 0, "wave": s - 1, "step": s, "time": s * self.seconds})
    if s % self.eval_every == 0 or s == self.total:
      self.check(params)
      self.rows[-1].update(self.evaluate(params))  # test_accuracy, test_loss
      logging.info("%s: %s %d/%d  t=%.4gs  test accuracy %.4f", self.what, self.unit, s, self.total,
                   self.rows[-1]["time"], self.rows[-1]["test_accuracy"])

  def check(self, params: Any) -> None:
    """Fetches the losses since the last check, and whether ``params`` are finite, in one transfer.

    Raises:
      RunStopped: naming the first step or round whose loss is not finite, or the last one when the weights are
        not finite.
    """
    losses, finite = jax.device_get((self.losses[len(self.fetched):], _all_finite(params)))
    for loss in losses:
      self.fetched.append(float(loss))
      if not math.isfinite(self.fetched[-1]):
        raise RunStopped(f"{self.what}: the training loss of {self.unit} {len(self.fetched)} is {self.fetched[-1]} "
                         f"(not finite): the run diverged; {self.hint}")
    if not finite:
      raise RunStopped(f"{self.what}: the weights after {self.unit} {len(self.fetched)} are not finite (NaN or Inf): "
                       f"the run diverged; {self.hint}")

  def result(self) -> Rows:
    """The rows, each with its ``train_loss`` and ``examples`` (after the keys of HetPipe's rows)."""
    for row, loss, examples in zip(self.rows, self.fetched, self.examples):
      row["train_loss"] = loss
      row["examples"] = examples
    return self.rows


@overload
def train_weighted_sync(model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        batch_sizes: Sequence[int], steps: int, step_seconds: float, seed: int = 0,
                        eval_every: int = 10, device: Any = None, *, return_params: Literal[False] = False,
                        what: str | None = None) -> Rows: ...


@overload
def train_weighted_sync(model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        batch_sizes: Sequence[int], steps: int, step_seconds: float, seed: int = 0,
                        eval_every: int = 10, device: Any = None, *, return_params: Literal[True],
                        what: str | None = None) -> tuple[Rows, Any]: ...


def train_weighted_sync(model: LayeredModel, dataset: Dataset, tx: optax.GradientTransformation,
                        batch_sizes: Sequence[int], steps: int, step_seconds: float, seed: int = 0,
                        eval_every: int = 10, device: Any = None, *, return_params: bool = False,
                        what: str | None = None) -> Rows | tuple[Rows, Any]:
  """Trains ``model`` by synchronous SGD whose workers' gradients are weighted by their share of the batch.

  Every step worker i computes the mean gradient of its own minibatch of ``batch_sizes[i]`` examples; the
  gradients are combined weighted by b_i / sum(b) (the gradient of one batch of sum(b) examples; with equal
  sizes their plain mean, as Horovod's all-reduce) and ``tx`` updates the one copy of the weights.

  Args:
    model: the model.
    dataset: training and test data.
    tx: the optimizer, applied to the combined gradient.
    batch_sizes: examples of each worker's minibatch (0: that worker sits out; not all 0; none above the
      training set).
    steps: synchronous steps (0: no training, no rows).
    step_seconds: modelled seconds of one step (the clock of the metrics).
    seed: initialisation and shuffling seed (the streams: :class:`~hetpipe_jax.data.WorkerStreams`).
    eval_every: evaluate the test accuracy every this many steps (and at the end).
    device: where it runs, a ``jax.Device`` (default: the first JAX device).
    return_params: also return the final weights.
    what: the run's name in the log and errors (default: the batch sizes).

  Returns:
    Metrics rows like the HetPipe runs': ``{"vw": 0, "wave": step-1, "step", "time": step x step_seconds,
    "examples" (seen so far, all workers), "train_loss" (the batch-weighted mean)}`` per step, with
    ``test_accuracy`` every ``eval_every`` steps and at the end; with ``return_params``, ``(rows, params)``.

  Raises:
    ConfigError: for bad sizes, counts or seconds (:class:`~hetpipe_jax.data.WorkerStreams` says which).
    RunStopped: when a step's loss or the weights are not finite (the run diverged).
  """
  streams = WorkerStreams(dataset, batch_sizes, seed)
  steps = _check_count("steps", steps, 0)
  eval_every = _check_count("eval_every", eval_every, 1)
  step_seconds = _check_seconds("step_seconds", step_seconds)
  total = streams.examples_per_round
  sizes = streams.batch_sizes
  active = [i for i, b in enumerate(sizes) if b > 0]
  weights = [sizes[i] for i in active]
  device = device or jax.devices()[0]
  params = jax.device_put(model.init(jax.random.key(seed), jnp.asarray(dataset.x_train[:max(sizes)])), device)
  opt_state = tx.init(params)
  loss_fn = lambda p, x, y: model.loss(model.apply(p, x), y)

  grad = jax.jit(jax.value_and_grad(loss_fn))  # compiled once per distinct batch size

  @jax.jit
  def update(params, opt_state, results):
    # the weighted all-reduce: the batch-weighted mean of the workers' losses and gradients
    loss = _weighted_mean([r[0] for r in results], weights)
    grads = _tree_weighted_mean([r[1] for r in results], weights)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  what = what or f"synchronous SGD (batches {sizes})"
  track = _Tracker(model, dataset, device, what, "step", steps, eval_every, step_seconds,
                   "lower the learning rate")
  for s in range(1, steps + 1):
    results = [grad(params, *(jax.device_put(np.asarray(a), device) for a in streams(i, s))) for i in active]
    params, opt_state, loss = update(params, opt_state, results)
    track.record(s, params, loss, s * total)
  return (track.result(), params) if return_params else track.result()


def _check_outer(outer_lr: Any, outer_momentum: Any) -> None:
  if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float, np.number)) or not (
      math.isfinite(outer_lr) and outer_lr > 0):
    raise ConfigError(f"outer_lr={outer_lr!r}; the outer learning rate must be finite and > 0 (1.0 with momentum 0: "
                      "the weights become the workers' weighted mean; DiLoCo uses 0.7 with Nesterov momentum 0.9)")
  if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float, np.number)) or not (
      0 <= outer_momentum < 1):
    raise ConfigError(f"outer_momentum={outer_momentum!r}; it must be in [0, 1) (0: no momentum; DiLoCo uses 0.9)")


def outer_optimizer(outer_lr: float = 1.0, outer_momentum: float = 0.0,
                    nesterov: bool = True) -> optax.GradientTransformation:
  """The outer step of local SGD, applied to the averaged weight change d (the negated outer gradient).

  SGD with (Nesterov) momentum m: t <- m t + d, and the update is ``outer_lr`` x (d + m t) (Nesterov) or
  ``outer_lr`` x t, added to the weights: w <- w + update, i.e. w - lr x (outer gradient's momentum step).

  Raises:
    ConfigError: for ``outer_lr`` <= 0 or not finite, or ``outer_momentum`` outside [0, 1).
  """
  _check_outer(outer_lr, outer_momentum)
  return optax.chain(optax.trace(decay=float(outer_momentum), nesterov=nesterov), optax.scale(float(outer_lr)))


@overload
def train_local_sgd(model: LayeredModel, dataset: Dataset, inner_tx: optax.GradientTransformation,
                    batch_sizes: Sequence[int], local_steps: Sequence[int], rounds: int, round_seconds: float,
                    outer_lr: float = 1.0, outer_momentum: float = 0.0, nesterov: bool = True, seed: int = 0,
                    eval_every: int = 1, device: Any = None, *, return_params: Literal[False] = False,
                    what: str | None = None) -> Rows: ...


@overload
def train_local_sgd(model: LayeredModel, dataset: Dataset, inner_tx: optax.GradientTransformation,
                    batch_sizes: Sequence[int], local_steps: Sequence[int], rounds: int, round_seconds: float,
                    outer_lr: float = 1.0, outer_momentum: float = 0.0, nesterov: bool = True, seed: int = 0,
                    eval_every: int = 1, device: Any = None, *, return_params: Literal[True],
                    what: str | None = None) -> tuple[Rows, Any]: ...


def train_local_sgd(model: LayeredModel, dataset: Dataset, inner_tx: optax.GradientTransformation,
                    batch_sizes: Sequence[int], local_steps: Sequence[int], rounds: int, round_seconds: float,
                    outer_lr: float = 1.0, outer_momentum: float = 0.0, nesterov: bool = True, seed: int = 0,
                    eval_every: int = 1, device: Any = None, *, return_params: bool = False,
                    what: str | None = None) -> Rows | tuple[Rows, Any]:
  """Trains ``model`` by local SGD with an outer optimizer (DiLoCo).

  Every round each worker i starts from the global weights w and takes ``local_steps[i]`` (H_i) steps of
  ``inner_tx`` on its own minibatches of ``batch_sizes[i]`` examples (its inner optimizer state is its own,
  kept across rounds); its weight change is d_i = w_i - w. The changes are averaged weighted by the examples
  each worker processed in the round (H_i x b_i; equal: their plain mean, as DiLoCo) and the outer step
  (:func:`outer_optimizer`) moves w along the mean change d: with ``outer_lr`` 1 and momentum 0, w becomes
  the workers' weighted mean, and with H_i = 1 the round is one synchronous SGD step at the global batch.

  Args:
    model: the model.
    dataset: training and test data.
    inner_tx: each worker's optimizer (a fresh state per worker).
    batch_sizes: examples of each worker's minibatch (0: that worker sits out; not all 0).
    local_steps: H_i, each worker's steps per round (>= 1).
    rounds: synchronisations (0: no training, no rows).
    round_seconds: modelled seconds of one round (the clock of the metrics).
    outer_lr: the outer learning rate (> 0).
    outer_momentum: the outer momentum, in [0, 1).
    nesterov: Nesterov momentum (else heavy ball).
    seed: initialisation and shuffling seed (the streams: :class:`~hetpipe_jax.data.WorkerStreams`).
    eval_every: evaluate the test accuracy every this many rounds (and at the end).
    device: where it runs, a ``jax.Device`` (default: the first JAX device).
    return_params: also return the final global weights.
    what: the run's name in the log and errors (default: the batch sizes and local steps).

  Returns:
    Metrics rows: ``{"vw": 0, "wave": round-1, "step": round, "time": round x round_seconds, "examples" (seen
    so far, all workers), "train_loss" (the round's inner losses, weighted by examples)}`` per round, with
    ``test_accuracy`` every ``eval_every`` rounds and at the end; with ``return_params``, ``(rows, params)``.

  Raises:
    ConfigError: for bad sizes, local steps, counts, seconds or outer settings.
    RunStopped: when a round's loss or the global weights are not finite (the run diverged).
  """
  streams = WorkerStreams(dataset, batch_sizes, seed, local_steps)
  rounds = _check_count("rounds", rounds, 0)
  eval_every = _check_count("eval_every", eval_every, 1)
  round_seconds = _check_seconds("round_seconds", round_seconds)
  outer_tx = outer_optimizer(outer_lr, outer_momentum, nesterov)
  sizes, hs = streams.batch_sizes, streams.local_steps
  active = [i for i, b in enumerate(sizes) if b > 0]
  weights = [hs[i] * sizes[i] for i in active]  # examples per round
  device = device or jax.devices()[0]
  params = jax.device_put(model.init(jax.random.key(seed), jnp.asarray(dataset.x_train[:max(sizes)])), device)
  inner_states = {i: inner_tx.init(params) for i in active}
  outer_state = outer_tx.init(params)
  loss_fn = lambda p, x, y: model.loss(model.apply(p, x), y)

  @jax.jit
  def inner(params, opt_state, x, y):  # compiled once per distinct batch size
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = inner_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def outer(params, outer_state, local, losses):
    # the all-reduce of the weight changes, weighted by the examples each worker processed in the round
    deltas = [jax.tree.map(jnp.subtract, w, params) for w in local]
    mean_delta = _tree_weighted_mean(deltas, weights)
    # the round's loss: the mean over every example its inner steps processed
    loss = sum(sizes[i] * sum(per_worker) for i, per_worker in zip(active, losses)) / sum(weights)
    updates, outer_state = outer_tx.update(mean_delta, outer_state, params)
    return optax.apply_updates(params, updates), outer_state, loss

  what = what or f"local SGD (batches {sizes}, local steps {hs})"
  track = _Tracker(model, dataset, device, what, "round", rounds, eval_every, round_seconds,
                   "lower the inner or outer learning rate, or the local steps")
  for r in range(1, rounds + 1):
    local, losses = [], []
    for i in active:
      w, worker_losses = params, []
      for k in range(1, hs[i] + 1):
        x, y = (jax.device_put(np.asarray(a), device) for a in streams(i, r, k))
        w, inner_states[i], loss = inner(w, inner_states[i], x, y)
        worker_losses.append(loss)
      local.append(w)
      losses.append(worker_losses)
    params, outer_state, loss = outer(params, outer_state, local, losses)
    track.record(r, params, loss, r * streams.examples_per_round)
  return (track.result(), params) if return_params else track.result()

