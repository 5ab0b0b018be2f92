"""The virtual executor is deterministic: the same seed gives the same trace and numbers, bit for bit."""

import chex
import jax

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic

from helpers import assert_trace_ok


def _run(seed):
  return run_hetpipe(get_model("mlp"), synthetic(num_train=512, num_test=128), RunConfig(
      cluster="hetero4", num_vws=3, stages=(2, 1, 2), nm=(2, 3, 1), d=1, waves=6, batch_size=16,
      optimizer="adam", learning_rate=1e-3, seed=seed, eval_every=2))


def test_same_seed_same_bits():
  a, b = _run(0), _run(0)
  assert_trace_ok(a.events)
  assert a.events == b.events  # the schedule, timestamps included
  assert a.metrics == b.metrics  # losses and accuracies, exactly
  chex.assert_trees_all_equal(jax.device_get(a.params), jax.device_get(b.params))


def test_other_seed_other_numbers():
  a, c = _run(0), _run(1)
  assert_trace_ok(c.events)
  assert [r["train_loss"] for r in a.metrics] != [r["train_loss"] for r in c.metrics]
