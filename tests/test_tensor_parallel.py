"""Tensor parallelism inside a stage (hetpipe_jax/tensor.py): a stage split over 2 or 4 CPU devices computes what
one device computes (outputs, input gradients, weights after updates), keeps its weights split as Megatron-LM
does, and resumes from a checkpoint to the same numbers."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.gpt import gpt
from hetpipe_jax.runtime.stage import DEFAULT_OPTIONS, Stage, StageOptions
from hetpipe_jax.tensor import COLUMNS, ROWS, SPLIT, WHOLE, check_tp

MODEL = gpt(vocab_size=16, layers=2, width=16, heads=4, context=8)
TOKENS = jax.random.randint(jax.random.key(1), (4, 8), 0, 16)
LABELS = jnp.roll(TOKENS, -1, axis=1)
PARAMS = MODEL.init(jax.random.key(0), TOKENS)


def run(devices, units=range(4), tx=None, steps=3, options=DEFAULT_OPTIONS):
  """(outputs, input gradients, final weights) of ``steps`` forwards and backwards of a stage on ``devices``."""
  first, last = units.start, units.stop
  stage = Stage(MODEL, units, PARAMS[first:last], devices, tx or optax.adam(1e-2), nm=1, options=options)
  x = TOKENS if first == 0 else MODEL.apply(PARAMS, TOKENS, 0, first)
  labels = LABELS if last == MODEL.num_units else None
  outs, grads = [], []
  for mb in range(1, steps + 1):  # Nm = 1: minibatch mb is wave mb - 1
    out = stage.forward(mb, jax.device_put(x, stage.device), labels)
    ct = 1e-3 * jax.random.normal(jax.random.key(mb), out.shape)  # a middle stage's incoming gradient
    g = stage.backward(mb, None if stage.is_last else jax.device_put(ct, stage.device))
    stage.take_wave(mb - 1)
    outs.append(np.asarray(out))
    grads.append(None if g is None else np.asarray(g))
  return outs, grads, jax.tree.map(np.asarray, stage.params), stage


def assert_close(a, b, tol):
  """Equal within ``tol`` of each array's largest magnitude (a sum in another order rounds alike)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=tol * float(np.max(np.abs(y))), rtol=0)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("units", [range(0, 4), range(1, 3)], ids=["whole model", "blocks"])
def test_a_split_stage_computes_what_one_device_computes(degree, units):
  sgd = optax.sgd(0.05, momentum=0.9)  # not Adam: it scales the rounding noise of a zero gradient (the key bias's)
  one = run([jax.devices()[0]], units, sgd)
  split = run(jax.devices()[:degree], units, sgd)
  for i in range(3):  # the outputs and input gradients, and the weights after three updates
    assert_close(one[i], split[i], 2e-5)
  assert split[3].tp == degree and one[3].tp == 1


def test_recomputation_in_a_split_stage_keeps_the_numerics():
  plain = run(jax.devices()[:2], range(1, 3), optax.sgd(0.05))
  again = run(jax.devices()[:2], range(1, 3), optax.sgd(0.05), options=StageOptions(recompute="selective"))
  for i in range(3):
    assert_close(plain[i], again[i], 2e-5)


def split_as(array, spec) -> bool:
  return array.sharding.is_equivalent_to(NamedSharding(array.sharding.mesh, spec), array.ndim)


def test_weights_and_optimizer_state_are_split_as_megatron_does():
  *_, stage = run(jax.devices()[4:8], steps=1)
  block = stage.params[1]
  assert split_as(block["qkv"]["kernel"], COLUMNS) and split_as(block["proj"]["kernel"], ROWS)
  assert split_as(block["fc"]["kernel"], COLUMNS) and split_as(block["out"]["kernel"], ROWS)
  assert split_as(block["fc"]["bias"], SPLIT) and split_as(block["out"]["bias"], WHOLE)
  assert split_as(block["ln1"]["scale"], WHOLE) and not split_as(block["fc"]["kernel"], WHOLE)
  assert split_as(stage.params[0]["tokens"]["embedding"], WHOLE)  # the embedding has no rule: whole
  assert split_as(stage.params[3]["logits"]["kernel"], COLUMNS)  # the head splits the vocabulary
  shards = block["fc"]["kernel"].addressable_shards
  assert {s.device for s in shards} == set(jax.devices()[4:8]) and {s.data.shape for s in shards} == {(16, 16)}
  assert split_as(stage.state.opt_state[0].mu[1]["fc"]["kernel"], COLUMNS)  # Adam's moments split alike


def collectives(hlo: str | None) -> collections.Counter:
  return collections.Counter(re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|reduce-scatter)\(", hlo or ""))


def test_the_compiled_block_sums_its_partial_products_with_two_all_reduces_each_way():
  stage = Stage(MODEL, range(1, 2), PARAMS[1:2], jax.devices()[:2], optax.sgd(0.1), nm=1)
  x = jax.device_put(MODEL.apply(PARAMS, TOKENS, 0, 1), stage.device)
  out, vjp = stage._fwd(stage.params, x, None)
  forward = stage._fwd.lower(stage.params, x, None).compile().as_text()
  backward = stage._bwd_first.lower(vjp, out, stage.params, stage.state.opt_state, None).compile().as_text()
  # Megatron-LM's f and g: one all-reduce after attention and one after the MLP, and the same two backward;
  # no weight is gathered (each device computes with its own part)
  assert collectives(forward) == collectives(backward) == {"all-reduce": 2}


def test_a_resumed_split_stage_continues_bit_identically():
  devices = jax.devices()[:2]
  _, _, _, stage = run(devices, steps=2)
  snapshot = jax.tree.map(np.asarray, stage.checkpoint_state())
  resumed = Stage(MODEL, range(4), PARAMS, devices, optax.adam(1e-2), nm=1)
  resumed.warm_up(TOKENS, jax.device_put(LABELS, resumed.device))
  resumed.restore_checkpoint_state(snapshot)
  assert split_as(resumed.params[1]["qkv"]["kernel"], COLUMNS)
  for s in (stage, resumed):
    s.forward(3, jax.device_put(TOKENS, s.device), jax.device_put(LABELS, s.device))
    s.backward(3, None)
  for a, b in zip(jax.tree.leaves(stage.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_degree_that_does_not_divide_the_heads_is_refused():
  with pytest.raises(ConfigError, match="tensor-parallel degree 3 does not divide GPT block's heads"):
    Stage(MODEL, range(1, 2), PARAMS[1:2], jax.devices()[:3], optax.sgd(0.1), nm=1)


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_a_bad_tp_value_is_refused(value):
  with pytest.raises(ConfigError, match=f"tp={value!r}; use a positive integer"):
    check_tp(value)
  assert check_tp("auto") == "auto" and check_tp("4") == "4"
