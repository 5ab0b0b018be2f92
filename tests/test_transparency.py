"""One virtual worker with Nm = 1 and D = 0 is plain sequential SGD, whatever the stage count."""

import chex
import jax
import numpy as np
import optax
import pytest

from hetpipe_jax import MinibatchStreams, RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.models import cross_entropy

from helpers import assert_trace_ok

STEPS, BATCH, SEED = 24, 32, 3
DATA = synthetic(num_train=512, num_test=128)
MODEL = get_model("mlp")  # 4 units: cut into 1, 2 or 4 stages


def plain_sgd(tx):
  """A plain single-device jitted training loop: the reference."""
  batches = MinibatchStreams(DATA, BATCH, num_vws=1, seed=SEED)
  params = MODEL.init(jax.random.key(SEED), DATA.x_train[:BATCH])
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(MODEL.apply(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for p in range(1, STEPS + 1):
    params, opt_state, loss = step(params, opt_state, *batches(0, p))
    losses.append(float(loss))
  return losses, params


OPTIMIZERS = {"sgd": optax.sgd(0.1), "adam": optax.adam(3e-3)}
REFERENCE = {}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("k,executor", [(1, "virtual"), (2, "virtual"), (4, "virtual"), (2, "wall")])
def test_one_vw_nm1_equals_plain_sgd(optimizer, k, executor):
  tx = OPTIMIZERS[optimizer]
  if optimizer not in REFERENCE:
    REFERENCE[optimizer] = plain_sgd(tx)
  ref_losses, ref_params = REFERENCE[optimizer]
  result = run_hetpipe(MODEL, DATA, RunConfig.of(
      cluster="uniform8", num_vws=1, stages=k, nm=1, d=0, waves=STEPS, batch_size=BATCH, tx=tx,
      seed=SEED, executor=executor, eval_every=STEPS))
  assert_trace_ok(result.events)
  losses = [row["train_loss"] for row in result.metrics]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert ref_losses[-1] < 0.7 * ref_losses[0]  # the reference itself learns
  chex.assert_tree_all_finite(result.params)
  chex.assert_trees_all_close(jax.device_get(result.params), jax.device_get(ref_params), rtol=1e-5, atol=1e-6)
