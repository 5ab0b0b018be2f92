"""No update is lost or counted twice: between the virtual workers, the rebase and the parameter server.

A linear model (three Dense units, no activation) keeps the arithmetic exact enough to compare in float64:
* the final global weights equal the initial ones plus the sum of every pushed wave;
* every virtual worker's final local weights equal its last pull plus every wave it pushed after it
  (a rebase that dropped or re-added local updates would break this).
"""

import chex
import jax
import numpy as np
import pytest

from hetpipe_jax import ParameterServer, RunConfig, run_hetpipe, synthetic
from hetpipe_jax.models.base import DenseUnit, LayeredModel
from hetpipe_jax.run.executors import local as run_module

from helpers import assert_trace_ok

LINEAR = LayeredModel("linear", (DenseUnit(16, relu=False), DenseUnit(16, relu=False),
                                 DenseUnit(10, relu=False)), ("l0", "l1", "l2"))


def _f64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


@pytest.fixture
def log(monkeypatch):
  """Records every push and pull (in call order) of the parameter server a run builds."""
  events = []

  class RecordingPS(ParameterServer):

    def push(self, vw, wave, updates):
      events.append(("push", vw, tuple(_f64(updates[u]) for u in range(self.num_shards))))
      return super().push(vw, wave, updates)

    def pull(self, vw, block=True, timeout=None):
      snap = super().pull(vw, block, timeout)
      if snap is not None:
        events.append(("pull", vw, _f64(snap.params)))
      return snap

  monkeypatch.setattr(run_module, "ParameterServer", RecordingPS)
  return events


@pytest.mark.parametrize("executor", ["virtual", "wall"])
def test_every_update_lands_exactly_once(log, executor):
  result = run_hetpipe(LINEAR, synthetic(num_train=512, num_test=64), RunConfig.of(
      cluster="hetero4", num_vws=3, stages=(1, 2, 3), nm=(1, 2, 3), d=1, waves=8, batch_size=16,
      learning_rate=0.05, executor=executor, time_scale=2e3 if executor == "wall" else 0.0, eval_every=8))
  stats = assert_trace_ok(result.events)
  pushes = [e for e in log if e[0] == "push"]
  assert len(pushes) == 3 * 8
  assert sum(1 for e in log if e[0] == "pull") > 0

  expected = _f64(result.init_params)
  for _, _, update in pushes:
    expected = jax.tree.map(np.add, expected, update)
  chex.assert_trees_all_close(_f64(result.params), expected, rtol=1e-5, atol=1e-6)

  for vw in result.vws:
    pull_at = max([n for n, e in enumerate(log) if e[0] == "pull" and e[1] == vw.index], default=None)
    base = _f64(result.init_params) if pull_at is None else log[pull_at][2]
    for n, (kind, i, update) in enumerate(log):
      if kind == "push" and i == vw.index and (pull_at is None or n > pull_at):
        base = jax.tree.map(np.add, base, update)
    for stage in vw.stages:
      local = jax.tree.leaves(stage.params)
      for got, want in zip(local, jax.tree.leaves(base[stage.first:stage.last])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert stats["max_global_staleness"] is not None
