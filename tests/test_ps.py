"""Parameter server: optax apply on push, clocks, gate, blocking pulls, and no lost updates under threads."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import ParameterServer, wsp
from hetpipe_jax.errors import ProtocolError


def _params():
  return ({"w": jnp.zeros((3, 2))}, {"b": jnp.ones(4)})


def _update(scale):
  return {0: {"w": jnp.full((3, 2), scale)}, 1: {"b": jnp.full(4, scale)}}


def test_push_adds_the_wave_as_is_and_ticks_the_clock():
  ps = ParameterServer(_params(), num_vws=2, d=0)
  clock = ps.push(0, 0, _update(0.5))
  assert clock.c_local == (1, 0)
  np.testing.assert_allclose(ps.params[0]["w"], 0.5)
  np.testing.assert_allclose(ps.params[1]["b"], 1.5)


def test_push_goes_through_the_optax_apply_rule():
  ps = ParameterServer(_params(), num_vws=1, d=0, tx=optax.scale(0.1))
  ps.push(0, 0, _update(1.0))
  np.testing.assert_allclose(ps.params[0]["w"], 0.1)


@pytest.mark.parametrize("tx", [None, optax.trace(decay=0.5)])
def test_a_push_its_producer_checked_applies_in_one_pass_as_the_checked_one_does(tx):
  checked, trusted = (ParameterServer(_params(), num_vws=1, d=0, tx=tx) for _ in range(2))
  for wave, scale in enumerate((0.5, -0.25, 2.0)):
    checked.push(0, wave, _update(scale))
    trusted.push(0, wave, _update(scale), nonfinite=[])  # (the producer found every shard finite)
  for a, b in zip(jax.tree.leaves(checked.params), jax.tree.leaves(trusted.params)):
    np.testing.assert_array_equal(a, b)  # bit-identical


def test_a_push_its_producer_found_not_finite_is_refused_without_touching_the_weights():
  from hetpipe_jax.errors import NonFiniteUpdate
  ps = ParameterServer(_params(), num_vws=1, d=0)
  with pytest.raises(NonFiniteUpdate):
    ps.push(0, 0, _update(0.5), nonfinite=[1])  # (the server does not look again: the producer said so)
  np.testing.assert_array_equal(ps.params[0]["w"], 0.0)
  skip = ParameterServer(_params(), num_vws=1, d=0, on_nonfinite="skip")
  assert skip.push(0, 0, _update(0.5), nonfinite=[1]).c_local == (1,)  # the wave counts, its update is dropped
  assert skip.dropped == {(0, 0): [1]}
  np.testing.assert_array_equal(skip.params[1]["b"], 1.0)


def test_push_rejects_out_of_order_repeated_and_partial_waves():
  ps = ParameterServer(_params(), num_vws=2, d=0)
  with pytest.raises(ProtocolError, match="pushed wave 1 but its clock is 0"):
    ps.push(0, 1, _update(1.0))
  ps.push(0, 0, _update(1.0))
  with pytest.raises(ProtocolError, match="pushed wave 0 but its clock is 1"):
    ps.push(0, 0, _update(1.0))
  with pytest.raises(ProtocolError, match="cover all 2 shards"):
    ps.push(1, 0, {0: _update(1.0)[0]})


def test_pull_respects_the_gate():
  ps = ParameterServer(_params(), num_vws=2, d=0)
  ps.push(0, 0, _update(1.0))
  assert ps.pull(0, block=False) is None  # c_local(0) - c_global = 1 > D = 0
  with pytest.raises(TimeoutError):
    ps.pull(0, timeout=0.05)
  snap = ps.pull(1, block=False)
  assert snap.waves == (1, 0)
  ps.push(1, 0, _update(1.0))
  assert ps.pull(0, block=False).waves == (1, 1)


def test_blocking_pull_wakes_on_the_slow_workers_push():
  ps = ParameterServer(_params(), num_vws=2, d=0)
  ps.push(0, 0, _update(1.0))
  got = []
  waiter = threading.Thread(target=lambda: got.append(ps.pull(0, timeout=10)))
  waiter.start()
  ps.push(1, 0, _update(2.0))
  waiter.join(10)
  assert got and got[0].waves == (1, 1)
  np.testing.assert_allclose(got[0].params[0]["w"], 3.0)


@pytest.mark.parametrize("d", [0, 2])
def test_no_lost_updates_under_concurrent_pushes_and_pulls(d):
  """8 threads push random waves and pull through the gate; the PS ends at init + the sum of pushes."""
  n, waves = 8, 25
  ps = ParameterServer(_params(), num_vws=n, d=d)
  rng = np.random.default_rng(0)
  updates = rng.normal(size=(n, waves, 3, 2)).astype(np.float32)
  gaps, errors = [], []

  def worker(i):
    try:
      for c in range(waves):
        ps.push(i, c, {0: {"w": jnp.asarray(updates[i, c])}, 1: {"b": jnp.full(4, 1.0)}})
        snap = ps.pull(i, timeout=30)
        gaps.append(snap.waves[i] - min(snap.waves))
        assert snap.waves[i] == c + 1
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors, errors
  assert ps.clock.c_local == (waves,) * n
  assert max(gaps) <= d  # every pull passed the gate
  np.testing.assert_allclose(ps.params[0]["w"], updates.astype(np.float64).sum(axis=(0, 1)), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(ps.params[1]["b"], 1.0 + n * waves)


def test_global_weights_live_on_the_chosen_device():
  dev = jax.devices()[3]
  ps = ParameterServer(_params(), num_vws=1, d=0, device=dev)
  assert all(x.devices() == {dev} for x in jax.tree.leaves(ps.params))


def test_clock_is_the_pure_state():
  ps = ParameterServer(_params(), num_vws=2, d=1)
  ps.push(1, 0, _update(1.0))
  assert ps.clock == wsp.push(wsp.init(2), 1)
