"""The numerics of the synchronous and local-SGD peers of HetPipe, for the convergence study: one trainer,
:func:`train_sgd`.

* **Synchronous SGD** (``local_steps`` None): worker i computes the gradient of its own minibatch of
  ``batch_sizes[i]`` examples and the gradients are combined weighted by each worker's share b_i / sum(b): the
  gradient of one batch of sum(b) examples, one optimizer update per step. It is the numerics of
  heterogeneity-aware data parallelism (``hetero_dp``: a GPU's share of the global batch, computed at once or by
  gradient accumulation, which is numerically the same), of synchronous heterogeneous pipelines
  (``sync_pipeline``: a pipeline's microbatches x batch) and, with equal sizes, of Horovod
  (:func:`hetpipe_jax.baselines.data_parallel.train_data_parallel`).
* **Local SGD** with an outer optimizer (``local_steps`` given; DiLoCo, arXiv 2311.08105; a number of local steps
  per worker as in asynchronous local SGD, arXiv 2401.09135). Every round each worker starts from the global
  weights, takes its H_i steps of the inner optimizer (whose state it keeps across rounds), and the weight
  changes, averaged weighted by the examples each worker processed, are the negated outer gradient of an SGD
  (Nesterov) momentum step (:func:`outer_optimizer`). With H_i = 1, plain SGD inside and the plain outer step
  (lr 1, momentum 0) a round is one synchronous step (equal up to rounding; the tests hold it).

Each worker reads its own stream (:class:`hetpipe_jax.data.WorkerStreams`): every example is seen once per
epoch across the workers. The clock is the modelled seconds of one step or round, given by the caller (the
timing side). Each worker's gradient or inner step is one jitted call (one compilation per distinct batch
size); the combine and update are one more, summing the workers in their order (deterministic). A
non-finite training loss or weights stop the run (:class:`~hetpipe_jax.errors.RunStopped`, naming the step),
checked at every evaluation with one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetpipe_jax.data import Dataset, WorkerStreams
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.evaluate import make_evaluator
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.runtime.numerics.mixed import all_finite


class MetricsRow(NamedTuple):
  """A step (synchronous) or round (local SGD) of a run, as HetPipe's metrics rows.

  Attributes:
    vw: 0 (one copy of the weights).
    wave: the step or round, from 0.
    step: the step or round, from 1.
    time: ``step`` x its modelled seconds.
    train_loss: the step's batch-weighted mean loss (a round's: over every example its inner steps saw).
    examples: examples seen so far, every worker together.
    test_accuracy / test_loss: at an evaluation (every ``eval_every`` and the last), else None.
  """

  vw: int
  wave: int
  step: int
  time: float
  train_loss: float
  examples: int
  test_accuracy: float | None = None
  test_loss: float | None = None

  def as_dict(self) -> dict[str, Any]:
    """The row as a metrics line (without the test fields between evaluations)."""
    return {k: v for k, v in self._asdict().items() if v is not None}


class TrainResult(NamedTuple):
  """A run of :func:`train_sgd`: its ``rows`` (one per step or round) and final (global) weights ``params``."""

  rows: list[MetricsRow]
  params: Any


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

  def __init__(self, evaluate: Callable[[Any], dict[str, float]], what: str, unit: str, total: int,
               eval_every: int, seconds: float):
    self.evaluate, self.what, self.unit, self.total, self.eval_every, self.seconds = (evaluate, what, unit, total,
                                                                                      eval_every, seconds)
    self.hint = "lower the learning rate" if unit == "step" else ("lower the inner or outer learning rate, or the "
                                                                 "local steps")
    self.tests: dict[int, dict[str, float]] = {}  # step -> its evaluation
    self.examples: list[int] = []
    self.losses: list[Any] = []  # on the device until checked
    self.fetched: list[float] = []

  def record(self, s: int, params: Any, loss: Any, examples: int) -> None:
    """Step or round ``s`` (from 1) ended with ``params``, its mean training loss ``loss`` (on the device), and
    ``examples`` seen so far."""
    self.losses.append(loss)
    self.examples.append(examples)
    if s % self.eval_every == 0 or s == self.total:
      self.check(params)
      self.tests[s] = self.evaluate(params)  # test_accuracy, test_loss
      logging.info("%s: %s %d/%d  t=%.4gs  test loss %.4f, accuracy %.4f", self.what, self.unit, s, self.total,
                   s * self.seconds, self.tests[s]["test_loss"], self.tests[s]["test_accuracy"])

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

  def rows(self) -> list[MetricsRow]:
    """One row per step or round."""
    return [MetricsRow(0, s - 1, s, s * self.seconds, loss, examples, **self.tests.get(s, {}))
            for s, (loss, examples) in enumerate(zip(self.fetched, self.examples), start=1)]


Round = Callable[[Any, int], tuple[Any, Any]]  # (params, round from 1) -> (params, the round's mean loss)


def fsdp_shardings(tree: Any, mesh: Mesh) -> Any:
  """ZeRO stage 3's layout of ``tree`` (weights, gradients or optimizer state) over ``mesh``'s one axis: each leaf
  split along its first dimension that the devices divide, a leaf with none (a scalar, an odd bias) whole on
  each."""
  n = mesh.devices.size

  def sharding(leaf: Any) -> NamedSharding:
    axis = next((a for a, d in enumerate(np.shape(leaf)) if d % n == 0), None)
    return NamedSharding(mesh, P() if axis is None else P(*([None] * axis), mesh.axis_names[0]))
  return jax.tree.map(sharding, tree)


def _placement(device: Any) -> tuple[Any, Callable[[Any], Any]]:
  """Where a worker's batch goes, and how the weights and the optimizer state are placed: on ``device`` (one
  ``jax.Device``), or over a sequence of devices sharded by :func:`fsdp_shardings` (each batch whole on all)."""
  if isinstance(device, jax.Device):
    return device, lambda tree: jax.device_put(tree, device)
  mesh = Mesh(np.array(list(device)), ("fsdp",))
  return NamedSharding(mesh, P()), lambda tree: jax.device_put(tree, fsdp_shardings(tree, mesh))


def _sync_round(loss_fn: Callable, tx: optax.GradientTransformation, streams: WorkerStreams, active: list[int],
                params: Any, placement: tuple[Any, Callable[[Any], Any]]) -> Round:
  """A synchronous step: every active worker's gradient, their batch-weighted mean, one update of ``tx``
  (``placement``: :func:`_placement`'s, where the batches go and how the optimizer state is placed)."""
  weights = [streams.batch_sizes[i] for i in active]
  grad = jax.jit(jax.value_and_grad(loss_fn))  # compiled once per distinct batch size
  device, place = placement
  state = {"opt": place(tx.init(params))}

  @jax.jit
  def update(params, opt_state, results):
    # the weighted all-reduce: the batch-weighted mean of the workers' losses and gradients
    loss = _weighted_mean([r[0] for r in results], weights)
    grads = _tree_weighted_mean([r[1] for r in results], weights)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def step(params: Any, s: int) -> tuple[Any, Any]:
    results = [grad(params, *(jax.device_put(np.asarray(a), device) for a in streams(i, s))) for i in active]
    params, state["opt"], loss = update(params, state["opt"], results)
    return params, loss
  return step


def _local_round(loss_fn: Callable, inner_txs: Sequence[optax.GradientTransformation],
                 outer_tx: optax.GradientTransformation, streams: WorkerStreams, active: list[int], params: Any,
                 device: Any) -> Round:
  """A round of local SGD: every active worker's H_i inner steps (its own ``inner_txs[i]``) from the global weights,
  the example-weighted mean of their weight changes, one outer step."""
  sizes, hs = streams.batch_sizes, streams.local_steps
  weights = [hs[i] * sizes[i] for i in active]  # examples per round
  inner_states = {i: inner_txs[i].init(params) for i in active}
  state = {"outer": outer_tx.init(params)}

  def inner_step(tx):
    @jax.jit
    def inner(params, opt_state, x, y):  # compiled once per distinct batch size
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss
    return inner
  shared = inner_step(inner_txs[active[0]])  # one compiled step for workers that share a transformation
  inners = {i: shared if inner_txs[i] is inner_txs[active[0]] else inner_step(inner_txs[i]) for i in active}

  @jax.jit
  def outer(params, outer_state, local, losses):
    # the all-reduce of the weight changes, weighted by the examples each worker processed in the round
    mean_delta = _tree_weighted_mean([jax.tree.map(jnp.subtract, w, params) for w in local], weights)
    # the round's loss: the mean over every example its inner steps processed
    loss = sum(sizes[i] * sum(per_worker) for i, per_worker in zip(active, losses)) / sum(weights)
    updates, outer_state = outer_tx.update(mean_delta, outer_state, params)
    return optax.apply_updates(params, updates), outer_state, loss

  def step(params: Any, r: int) -> tuple[Any, Any]:
    local, losses = [], []
    for i in active:
      w, worker_losses = params, []
      for k in range(1, hs[i] + 1):
        x, y = (jax.device_put(np.asarray(a), device) for a in streams(i, r, k))
        w, inner_states[i], loss = inners[i](w, inner_states[i], x, y)
        worker_losses.append(loss)
      local.append(w)
      losses.append(worker_losses)
    params, state["outer"], loss = outer(params, state["outer"], local, losses)
    return params, loss
  return step


def train_sgd(*, model: LayeredModel, dataset: Dataset,
              tx: optax.GradientTransformation | Sequence[optax.GradientTransformation], batch_sizes: Sequence[int],
              rounds: int, round_seconds: float, local_steps: Sequence[int] | None = None,
              outer: optax.GradientTransformation | None = None, seed: int = 0, eval_every: int = 1,
              device: Any = None, what: str | None = None) -> TrainResult:
  """Trains ``model`` by synchronous SGD (``local_steps`` None) or local SGD (the module docstring).

  Args:
    model: the model.
    dataset: training and test data.
    tx: the optimizer: of the combined gradient (synchronous), or each worker's own (local SGD: a fresh state per
      worker, kept across rounds; or one transformation per worker, e.g. a learning-rate schedule over each
      worker's own inner steps).
    batch_sizes: examples of each worker's minibatch (0: that worker sits out; not all 0; none above the
      training set).
    rounds: synchronous steps, or local SGD's synchronisations (0: no training, no rows).
    round_seconds: modelled seconds of one step or round (the clock of the metrics).
    local_steps: H_i, each worker's steps per round (>= 1); None: synchronous SGD.
    outer: local SGD's outer step (:func:`outer_optimizer`; None: lr 1, no momentum, the weighted mean).
    seed: initialisation and shuffling seed (the streams: :class:`~hetpipe_jax.data.WorkerStreams`).
    eval_every: evaluate the test accuracy every this many steps or rounds (and at the end).
    device: where it runs, a ``jax.Device`` (default: the first JAX device), or (synchronous SGD) a sequence of
      devices over which the weights, the gradients and the optimizer state are sharded as ZeRO stage 3 holds
      them (:func:`fsdp_shardings`; XLA gathers the weights for each gradient and updates each shard where it
      lives): the same update within rounding (``tests/test_peer_numerics.py``).
    what: the run's name in the log and errors (default: the batch sizes and local steps).

  Returns:
    The rows (one per step or round) and the final weights.

  Raises:
    ConfigError: for bad sizes, local steps, counts or seconds (:class:`~hetpipe_jax.data.WorkerStreams` says
      which), or ``outer`` given to synchronous SGD.
    RunStopped: when a step's loss or the weights are not finite (the run diverged).
  """
  streams = WorkerStreams(dataset, batch_sizes, seed, local_steps)
  rounds = _check_count("rounds", rounds, 0)
  eval_every = _check_count("eval_every", eval_every, 1)
  round_seconds = _check_seconds("round_seconds", round_seconds)
  if local_steps is None and outer is not None:
    raise ConfigError("an outer optimizer for synchronous SGD; give local_steps (local SGD) or no outer optimizer")
  txs = [tx] * len(batch_sizes) if isinstance(tx, optax.GradientTransformation) else list(tx)
  if len(txs) != len(batch_sizes) or (local_steps is None and len(set(map(id, txs))) > 1):
    raise ConfigError(f"{len(txs)} optimizers for {len(batch_sizes)} workers; give one optimizer, or (local SGD) one "
                      "per worker")
  sizes = streams.batch_sizes
  active = [i for i, b in enumerate(sizes) if b > 0]
  device = device or jax.devices()[0]
  if not isinstance(device, jax.Device) and local_steps is not None:
    raise ConfigError("weights sharded over several devices for local SGD; its workers keep their own weights: give "
                      "one device, or synchronous SGD (local_steps None)")
  placement = _placement(device)
  params = placement[1](model.init(jax.random.key(seed), jnp.asarray(dataset.x_train[:max(sizes)])))
  loss_fn = lambda p, x, y: model.loss(model.apply(p, x), y)
  if local_steps is None:
    step = _sync_round(loss_fn, txs[0], streams, active, params, placement)
    what, unit = what or f"synchronous SGD (batches {sizes})", "step"
  else:
    step = _local_round(loss_fn, txs, outer or outer_optimizer(), streams, active, params, device)
    what, unit = what or f"local SGD (batches {sizes}, local steps {streams.local_steps})", "round"
  evaluate = make_evaluator(model, dataset, device if isinstance(device, jax.Device) else next(iter(device)))
  track = _Tracker(evaluate, what, unit, rounds, eval_every, round_seconds)
  for r in range(1, rounds + 1):
    params, loss = step(params, r)
    track.record(r, params, loss, r * streams.examples_per_round)
  return TrainResult(track.rows(), params)


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


