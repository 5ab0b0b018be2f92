"""The virtual executor is deterministic: the same seed gives the same trace and numbers, bit for bit."""

import os

import chex
import jax
import pytest

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic

from helpers import assert_trace_ok


def _run(seed):
  return run_hetpipe(get_model("mlp"), synthetic(num_train=512, num_test=128), RunConfig.of(
      cluster="hetero4", num_vws=3, stages=(2, 1, 2), nm=(2, 3, 1), d=1, waves=6, batch_size=16,
      optimizer="adam", learning_rate=1e-3, seed=seed, eval_every=2))


@pytest.mark.slow  # (15 s: the README's test command keeps under 10 minutes; .ci/run runs it)
def test_same_seed_same_bits():
  a, b = _run(0), _run(0)
  assert_trace_ok(a.events)
  assert a.events == b.events  # the schedule, timestamps included
  assert a.metrics == b.metrics  # losses and accuracies, exactly
  chex.assert_trees_all_equal(jax.device_get(a.params), jax.device_get(b.params))


@pytest.mark.slow  # 10-16 s: the fast suite keeps under 10 minutes
def test_other_seed_other_numbers():
  a, c = _run(0), _run(1)
  assert_trace_ok(c.events)
  assert [r["train_loss"] for r in a.metrics] != [r["train_loss"] for r in c.metrics]


def test_compiled_programs_come_back_from_the_cache_with_the_same_bits():
  """conftest.py turns JAX's persistent compilation cache on (as the experiment scripts do): a run whose
  stage programs an earlier run compiled loads them from the cache, and its numbers are the same."""
  from jax import monitoring
  hits = []
  listener = lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
  first = _run(3)
  monitoring.register_event_listener(listener)
  try:
    again = _run(3)
  finally:
    monitoring.unregister_event_listener(listener)
  assert hits, "the second run compiled every program again"
  assert_trace_ok(again.events)
  assert again.events == first.events and again.metrics == first.metrics
  chex.assert_trees_all_equal(jax.device_get(first.params), jax.device_get(again.params))


def test_compilation_cache_location(monkeypatch):
  from hetpipe_jax.cluster import enable_compilation_cache
  session = os.environ["HETPIPE_JAX_XLA_CACHE"]  # conftest.py's, inside the session's temporary directory
  assert jax.config.jax_compilation_cache_dir == session
  assert enable_compilation_cache() == session
  monkeypatch.setenv("HETPIPE_JAX_XLA_CACHE", "")
  assert enable_compilation_cache() is None  # off: the setting is left as it was
  assert jax.config.jax_compilation_cache_dir == session
