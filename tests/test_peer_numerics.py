"""The peers' numerics: the batch-weighted synchronous step is one big-batch step, local SGD with one local
step and the plain outer step is synchronous SGD, equal batches are today's data parallelism bit for bit,
the outer Nesterov step is the hand-computed recurrence, and bad inputs or a divergence stop with one line.

Tolerances: a weighted mean of per-worker mean gradients sums the same float32 terms as one big batch's mean,
in another order and with one more rounding per worker (b_i / B x mean_i), so the two differ by a few ulps
per step (relative 1e-7 .. 1e-6 after a few steps, far below rtol 1e-5); local SGD's weight changes
w_i - w cancel the leading digits of w (an absolute error of about eps x |w| ~ 1e-7 per round), hence its
atol 1e-6."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import MinibatchStreams, get_model, synthetic
from hetpipe_jax.baselines.data_parallel import train_data_parallel
from hetpipe_jax.baselines.numerics import outer_optimizer, train_sgd
from hetpipe_jax.data import WorkerStreams
from hetpipe_jax.errors import ConfigError, RunStopped
from hetpipe_jax.models.base import cross_entropy

from helpers import F32_U, reorder_bound

DATA = synthetic(num_train=512, num_test=128)
MODEL = get_model("mlp")
LOSS = jax.jit(jax.value_and_grad(lambda p, x, y: cross_entropy(MODEL.apply(p, x), y)))


def sync_sgd(tx, batch_sizes, steps, step_seconds, **kw):
  """Synchronous SGD: :func:`train_sgd` without local steps."""
  return train_sgd(model=MODEL, dataset=DATA, tx=tx, batch_sizes=batch_sizes, rounds=steps, round_seconds=step_seconds,
                   **kw)


def local_sgd(tx, batch_sizes, local_steps, rounds, round_seconds, outer_lr=1.0, outer_momentum=0.0, **kw):
  """Local SGD with the outer Nesterov step."""
  return train_sgd(model=MODEL, dataset=DATA, tx=tx, batch_sizes=batch_sizes, local_steps=local_steps, rounds=rounds,
                   round_seconds=round_seconds, outer=outer_optimizer(outer_lr, outer_momentum), **kw)


def init(batch: int, seed: int = 0):
  return MODEL.init(jax.random.key(seed), jnp.asarray(DATA.x_train[:batch]))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_worker_streams_are_minibatch_streams_for_equal_sizes():
  for n, b in ((5, 16), (1, 32), (3, 128)):  # 5 x 16: steps straddle epochs (32 batches an epoch)
    old, new = MinibatchStreams(DATA, b, n, seed=3), WorkerStreams(DATA, [b] * n, seed=3)
    for s in range(1, 30):
      for i in range(n):
        for a, c in zip(old(i, s), new(i, s)):
          np.testing.assert_array_equal(a, c)


def test_unequal_streams_see_every_example_once_per_epoch():
  streams = WorkerStreams(DATA, [3, 0, 5, 24], seed=1, local_steps=[2, 4, 1, 3])
  assert streams.examples_per_round == 3 * 2 + 5 + 24 * 3
  order = [streams.indices(streams.position(i, r, k), streams.batch_sizes[i])
           for r in range(1, 30) for i in range(4) for k in range(1, streams.local_steps[i] + 1)]
  seen = np.concatenate(order)
  assert len(seen) == 29 * 83
  for e in range(len(seen) // 512):
    np.testing.assert_array_equal(np.sort(seen[e * 512:(e + 1) * 512]), np.arange(512))
  assert len(streams(1, 5, 3)[0]) == 0  # batch 0: the worker takes nothing
  other = WorkerStreams(DATA, [3, 0, 5, 24], seed=2, local_steps=[2, 4, 1, 3])
  assert not np.array_equal(streams(3, 4, 2)[1], other(3, 4, 2)[1])  # seeded


@pytest.mark.parametrize("sizes", [[3, 5], [7, 1, 24]])
def test_weighted_sync_step_is_one_big_batch_step(sizes):
  tx = optax.sgd(0.1, momentum=0.5)
  steps = 3
  rows, params = sync_sgd(tx, sizes, steps, 0.5, seed=4, eval_every=steps)
  big = WorkerStreams(DATA, [sum(sizes)], seed=4)  # the same examples: the workers' batches concatenated
  ref = init(max(sizes), seed=4)
  state = tx.init(ref)
  losses = []
  for s in range(1, steps + 1):
    x, y = big(0, s)
    np.testing.assert_array_equal(x, np.concatenate([WorkerStreams(DATA, sizes, 4)(i, s)[0]
                                                     for i in range(len(sizes))]))
    loss, grads = LOSS(ref, x, y)
    updates, state = tx.update(grads, state, ref)
    ref = optax.apply_updates(ref, updates)
    losses.append(float(loss))
  assert_trees_close(params, ref)
  np.testing.assert_allclose([r.train_loss for r in rows], losses, rtol=1e-5)
  assert [r.examples for r in rows] == [s * sum(sizes) for s in range(1, steps + 1)]
  assert [r.time for r in rows] == [0.5, 1.0, 1.5] and rows[-1].test_accuracy is not None


def test_a_worker_of_batch_zero_sits_out():
  a_rows, a = sync_sgd(optax.sgd(0.1), [3, 5], 4, 1.0, seed=2)
  b_rows, b = sync_sgd(optax.sgd(0.1), [3, 0, 5, 0], 4, 1.0, seed=2)
  assert a_rows == b_rows
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def old_train_data_parallel(tx, num_workers, steps, batch_size, step_seconds, seed, eval_every):
  """The data-parallel baseline as it was before the peers (the reference of bit-for-bit identity)."""
  from hetpipe_jax.evaluate import make_evaluator
  device = jax.devices()[0]
  streams = MinibatchStreams(DATA, batch_size, num_workers, seed)
  params = jax.device_put(MODEL.init(jax.random.key(seed), jnp.asarray(DATA.x_train[:batch_size])), device)
  opt_state = tx.init(params)
  grad = jax.jit(jax.value_and_grad(lambda p, x, y: cross_entropy(MODEL.apply(p, x), y)))

  @jax.jit
  def update(params, opt_state, results):
    loss = sum(r[0] for r in results) / len(results)
    grads = jax.tree.map(lambda *g: sum(g) / len(g), *(r[1] for r in results))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = make_evaluator(MODEL, DATA, device)
  rows, losses = [], []
  for s in range(1, steps + 1):
    results = [grad(params, *(jax.device_put(np.asarray(a), device) for a in streams(w, s)))
               for w in range(num_workers)]
    params, opt_state, loss = update(params, opt_state, results)
    losses.append(loss)
    rows.append({"vw": 0, "wave": s - 1, "step": s, "time": s * step_seconds})
    if s % eval_every == 0 or s == steps:
      rows[-1].update(evaluate(params))
  for row, loss in zip(rows, jax.device_get(losses)):
    row["train_loss"] = float(loss)
  return rows


def test_equal_batches_are_todays_data_parallelism_bit_for_bit():
  tx = optax.adam(3e-3)
  old = old_train_data_parallel(tx, 5, 14, 16, 0.25, 1, 5)  # 5 x 16: steps straddle epochs
  new = train_data_parallel(model=MODEL, dataset=DATA, tx=tx, num_workers=5, batch_size=16, steps=14,
                            step_seconds=0.25, seed=1, eval_every=5).rows
  weighted = sync_sgd(tx, [16] * 5, 14, 0.25, seed=1, eval_every=5).rows
  assert new == weighted
  for a, b in zip(old, new, strict=True):
    assert a == {k: v for k, v in b.as_dict().items() if k != "examples"}  # same keys, same bits
    assert b.examples == b.step * 80


@pytest.mark.parametrize("sizes", [[3, 5], [16, 16]])
def test_local_sgd_with_one_local_step_and_the_plain_outer_step_is_synchronous_sgd(sizes):
  # plain SGD inside: with momentum or Adam, each worker's own inner state would differ from the one state
  rounds = 6
  sync_rows, sync = sync_sgd(optax.sgd(0.2), sizes, rounds, 1.0, seed=5, eval_every=3)
  local_rows, local = local_sgd(optax.sgd(0.2), sizes, [1] * len(sizes), rounds, 1.0, seed=5, eval_every=3)
  assert_trees_close(local, sync, atol=1e-6)
  np.testing.assert_allclose([r.train_loss for r in local_rows], [r.train_loss for r in sync_rows], rtol=1e-5)
  for a, b in zip(local_rows, sync_rows, strict=True):
    measured = ("train_loss", "test_accuracy", "test_loss")
    assert {k: v for k, v in a._asdict().items() if k not in measured} == \
        {k: v for k, v in b._asdict().items() if k not in measured}
    assert (a.test_accuracy is None) == (b.test_accuracy is None)
    if a.test_loss is not None:
      assert a.test_loss == pytest.approx(b.test_loss, rel=1e-5)


def test_outer_nesterov_is_the_hand_computed_recurrence():
  # one parameter, mean weight changes 1, 0.5, -0.25; lr 0.7, momentum 0.9:
  # Nesterov: t = 0.9 t + d, update = 0.7 (d + 0.9 t); heavy ball: update = 0.7 t
  deltas = [1.0, 0.5, -0.25]
  expected = {True: [0.7 * 1.9, 0.7 * (0.5 + 0.9 * 1.4), 0.7 * (-0.25 + 0.9 * 1.01)], False: [0.7, 0.98, 0.707]}
  for nesterov, want in expected.items():
    tx = outer_optimizer(0.7, 0.9, nesterov)
    w, state = jnp.zeros(()), tx.init(jnp.zeros(()))
    got = []
    for d in deltas:
      update, state = tx.update(jnp.float32(d), state, w)
      got.append(float(np.asarray(update)))
      w = optax.apply_updates(w, update)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(np.asarray(w)) == pytest.approx(sum(want), rel=1e-6)  # the weights move along the mean change


def test_local_sgd_rounds_are_the_hand_computed_outer_steps():
  """Two workers of batches 4 and 2 taking 1 and 3 local steps (momentum SGD, each its own state across
  rounds), weight changes averaged by examples (4 and 6), outer Nesterov lr 0.7 momentum 0.9, in numpy."""
  sizes, hs, rounds, lr, m = [4, 2], [1, 3], 3, 0.7, 0.9
  inner = optax.sgd(0.05, momentum=0.5)
  rows, params = local_sgd(inner, sizes, hs, rounds, 2.0, outer_lr=lr, outer_momentum=m, seed=6)
  streams = WorkerStreams(DATA, sizes, 6, hs)
  w = [np.asarray(a, np.float64) for a in jax.tree.leaves(init(4, seed=6))]
  treedef = jax.tree.structure(init(4, seed=6))
  trace = [np.zeros_like(a) for a in w]
  states = [inner.init(jax.tree.unflatten(treedef, [jnp.asarray(a, jnp.float32) for a in w])) for _ in sizes]
  for r in range(1, rounds + 1):
    mean = [np.zeros_like(a) for a in w]
    for i in range(2):
      p = jax.tree.unflatten(treedef, [jnp.asarray(a, jnp.float32) for a in w])
      for k in range(1, hs[i] + 1):
        _, g = LOSS(p, *streams(i, r, k))
        u, states[i] = inner.update(g, states[i], p)
        p = optax.apply_updates(p, u)
      share = sizes[i] * hs[i] / 10
      mean = [acc + share * (np.asarray(a, np.float64) - b) for acc, a, b in zip(mean, jax.tree.leaves(p), w)]
    trace = [m * t + d for t, d in zip(trace, mean)]
    w = [a + lr * (d + m * t) for a, d, t in zip(w, mean, trace)]
  assert_trees_close(params, jax.tree.unflatten(treedef, w), atol=1e-6)  # float32 against a float64 reference
  plain = local_sgd(inner, sizes, hs, rounds, 2.0, seed=6).params
  assert not np.allclose(np.asarray(jax.tree.leaves(plain)[0]), np.asarray(jax.tree.leaves(params)[0]))
  assert [r.examples for r in rows] == [10, 20, 30] and [r.time for r in rows] == [2.0, 4.0, 6.0]
  assert all(r.test_accuracy is not None and math.isfinite(r.train_loss) for r in rows)  # eval_every=1


SYNC = lambda **kw: sync_sgd(optax.sgd(0.1), **{"batch_sizes": [4, 4], "steps": 2, "step_seconds": 1.0, **kw})
LOCAL = lambda **kw: local_sgd(optax.sgd(0.1), **{
    "batch_sizes": [4, 4], "local_steps": [2, 2], "rounds": 2, "round_seconds": 1.0, **kw})


@pytest.mark.parametrize("run,kw,words", [
    (SYNC, {"batch_sizes": []}, "batch_sizes is empty"),
    (SYNC, {"batch_sizes": [4, -1]}, "batch_sizes[1]=-1"),
    (SYNC, {"batch_sizes": [4, 2.5]}, "batch_sizes[1]=2.5"),
    (SYNC, {"batch_sizes": [0, 0]}, "all 0"),
    (SYNC, {"batch_sizes": [4, 513]}, "above the 512 training examples"),
    (SYNC, {"steps": -1}, "rounds=-1"),
    (SYNC, {"eval_every": 0}, "eval_every=0"),
    (SYNC, {"step_seconds": float("nan")}, "round_seconds=nan"),
    (SYNC, {"step_seconds": -1.0}, "round_seconds=-1.0"),
    (LOCAL, {"local_steps": [2]}, "local_steps has 1 entries but batch_sizes 2"),
    (LOCAL, {"local_steps": [2, 0]}, "local_steps[1]=0"),
    (LOCAL, {"local_steps": []}, "local_steps is empty"),
    (LOCAL, {"rounds": -2}, "rounds=-2"),
    (LOCAL, {"outer_lr": 0.0}, "outer_lr=0.0"),
    (LOCAL, {"outer_lr": -0.7}, "outer_lr=-0.7"),
    (LOCAL, {"outer_lr": float("inf")}, "outer_lr=inf"),
    (LOCAL, {"outer_momentum": 1.0}, "outer_momentum=1.0"),
    (LOCAL, {"outer_momentum": -0.1}, "outer_momentum=-0.1"),
    (LOCAL, {"outer_momentum": float("nan")}, "outer_momentum=nan"),
])
def test_bad_inputs_are_refused_in_one_line(run, kw, words):
  with pytest.raises(ConfigError) as e:
    run(**kw)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_data_parallel_refuses_bad_workers_and_batches():
  with pytest.raises(ConfigError, match="num_workers=0"):
    train_data_parallel(model=MODEL, dataset=DATA, tx=optax.sgd(0.1), num_workers=0, batch_size=32, steps=2,
                        step_seconds=1.0)
  with pytest.raises(ConfigError, match="does not divide"):
    train_data_parallel(model=MODEL, dataset=DATA, tx=optax.sgd(0.1), num_workers=2, batch_size=30, steps=2,
                        step_seconds=1.0)
  with pytest.raises(ConfigError, match="an outer optimizer for synchronous SGD"):
    train_sgd(model=MODEL, dataset=DATA, tx=optax.sgd(0.1), batch_sizes=[4], rounds=1, round_seconds=1.0,
              outer=outer_optimizer())


def test_a_divergence_stops_the_run_naming_the_step():
  with pytest.raises(RunStopped, match=r"step \d+ is (nan|inf|-inf) \(not finite\)|weights after step \d+"):
    sync_sgd(optax.sgd(1e30), [8, 8], 6, 1.0, eval_every=3)
  with pytest.raises(RunStopped, match="round"):
    local_sgd(optax.sgd(1e30), [8, 8], [2, 2], 3, 1.0)


def test_sharded_weights_gradients_and_optimizer_state_give_the_unsharded_update():
  """ZeRO stage 3's layout (hetero_dp with its weights sharded): every leaf that 4 devices divide lives in 4
  shards, and Adam's steps on the shards equal the unsharded run's within rounding."""
  devices = jax.devices()[:4]
  assert len(devices) == 4, "the tests run on 8 CPU devices (conftest)"
  tx, sizes = optax.adam(1e-2), [7, 3, 5, 1]
  whole = sync_sgd(tx, sizes, 6, 1.0)
  sharded = sync_sgd(tx, sizes, 6, 1.0, device=devices)
  split = [x for x in jax.tree.leaves(sharded.params) if len(x.sharding.device_set) == 4
           and x.addressable_shards[0].data.size * 4 == x.size]
  assert len(split) >= 2  # the kernels (the MLP's biases of odd width stay whole)
  # The tolerance from the arithmetic, not from one machine: the sharded layout (and another CPU's vector width)
  # sums each of a gradient's float32 reductions in another order; the longest path through the 4-layer MLP is 7
  # reductions (4 forward matmuls, 3 backward) of at most 128 terms, so a gradient moves by at most 7 reorder
  # bounds, relative. Adam's direction m^ / sqrt(v^) moves by at most about twice a relative change of its
  # gradients while t <= 6 (Cauchy-Schwarz on the moments: sum (1-b1)^2 b1^2k / ((1-b2) b2^k) over 6 steps, with
  # the bias corrections, comes to 1.02 for b1 0.9, b2 0.999; once for m^, once for sqrt(v^)), and a weight takes 6 such
  # steps of 1e-2; its own update rounds once a step (rtol). A loss is 4 matmuls, a 10-way log-sum-exp and a mean.
  steps, lr, per_gradient = 6, 1e-2, 7 * reorder_bound(128)
  assert_trees_close(sharded.params, whole.params, rtol=steps * F32_U, atol=steps * lr * 2 * per_gradient)
  assert [r.train_loss for r in sharded.rows] == pytest.approx([r.train_loss for r in whole.rows],
                                                                rel=6 * reorder_bound(128))
  with pytest.raises(ConfigError, match="weights sharded over several devices for local SGD"):
    local_sgd(tx, sizes, [2] * 4, 1, 1.0, device=devices)
