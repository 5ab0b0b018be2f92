"""fp16 with plain SGD (docs/PROTOCOL.md section 3.10): a stage runs its backward at its loss scale S and must
divide S out of the weight gradient. Adam normalises a gradient's size away, so a missing division hides under
it; under SGD one step would move a weight S = 65,536 times too far. Here one fp16 step of every stage of a
pipeline (first and last) moves the weights as fp32 SGD does (-lr x the gradient), within fp16's rounding;
and (slow) a short fp16 SGD run trains as the fp32 one, its trace checked."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions

from helpers import assert_trace_ok

MODEL = get_model("mlp")  # 4 units
DATA = synthetic(num_train=256, num_test=64)
BATCH, LR = 16, 0.05
CUTS = (0, 2, 4)  # a first and a last stage


def relative_error(x: np.ndarray, reference: np.ndarray) -> float:
  return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


@functools.cache
def initial_params():
  """Random weights in the model's shapes (drawn by numpy: compiling the model's init costs seconds)."""
  shapes = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), jnp.asarray(DATA.x_train[:BATCH])))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.1, s.shape), s.dtype), shapes)


@functools.cache
def sgd_step_fp32() -> list[np.ndarray]:
  """What one SGD step on the first minibatch moves every weight by, in fp32: -lr x the gradient of the loss."""
  params = initial_params()
  loss = lambda p: MODEL.loss(MODEL.apply(p, jnp.asarray(DATA.x_train[:BATCH])), jnp.asarray(DATA.y_train[:BATCH]))
  return [-LR * np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params))]


def fp16_step(weight_mode: str) -> tuple[list[np.ndarray], list[int]]:
  """What one fp16 step of the pipeline's stages (forwards, then backwards) under SGD moves every weight by, and
  each stage's skipped count."""
  params = initial_params()
  device = jax.devices()[0]
  stages = [Stage(MODEL, range(a, b), params[a:b], device, optax.sgd(LR), 1, StageOptions(weight_mode, "fp16"))
            for a, b in zip(CUTS, CUTS[1:])]
  x, labels = jnp.asarray(DATA.x_train[:BATCH]), jnp.asarray(DATA.y_train[:BATCH])
  for s in stages:
    x = s.forward(1, x, labels if s.is_last else None)
  g = None
  for s in reversed(stages):
    g = s.backward(1, g)
  after = [np.asarray(w) for s in stages for w in jax.tree.leaves(s.params)]
  skipped = []
  for s in stages:
    s.take_wave(0)
    skipped.append(s.take_skipped(0))
  return [w - np.asarray(w0) for w, w0 in zip(after, jax.tree.leaves(params))], skipped


@pytest.mark.parametrize("weight_mode", ["stash", "latest"])
def test_one_fp16_sgd_step_moves_every_weight_as_fp32_sgd_does(weight_mode):
  moved16, skipped = fp16_step(weight_mode)
  assert skipped == [0, 0]  # no overflow at the initial scale: the step was taken
  for d32, d16 in zip(sgd_step_fp32(), moved16, strict=True):
    assert np.abs(d32).max() > 0  # the step moves every weight array
    # fp16 compute (11-bit significands) through the model: measured within 0.07% (in norm) of fp32's
    assert relative_error(d16, d32) <= 0.01, (f"an fp16 SGD step moved a weight {np.abs(d16).max():.4g} "
                                              f"where fp32 moves it {np.abs(d32).max():.4g}")

def moved(result) -> list[np.ndarray]:
  """How far the run moved every global weight from its initial value."""
  return [np.asarray(w) - np.asarray(w0) for w, w0 in zip(jax.tree.leaves(result.params),
                                                          jax.tree.leaves(result.init_params))]


@pytest.mark.slow  # (two runs: about 30 s of CPU on this machine, most of it compiling)
def test_a_short_fp16_sgd_run_trains_as_fp32_does():
  """Two virtual workers under WSP, SGD, 2 waves: the fp16 run moves the global weights as the fp32 run does
  (within 5% in norm; measured 2.3% at most), its losses follow, and its trace checks."""
  base = dict(cluster="hetero4", batch_size=BATCH, seed=0, optimizer="sgd", learning_rate=LR, num_vws=2,
              stages=(1, 1), nm=(2, 1), d=1, waves=2, eval_every=2)
  runs = {p: run_hetpipe(MODEL, DATA, RunConfig.of(**base, precision=p)) for p in ("fp32", "fp16")}
  assert_trace_ok(runs["fp16"].events)
  assert runs["fp16"].events[0]["precision"] == "fp16"
  assert all("skipped" not in ev for ev in runs["fp16"].events if ev["ev"] == "push")  # every step taken
  for d32, d16 in zip(moved(runs["fp32"]), moved(runs["fp16"])):
    assert np.abs(d32).max() > 0 and relative_error(d16, d32) <= 0.05, (
        f"the fp16 run moved a weight {np.abs(d16).max():.4g} where fp32 moved it {np.abs(d32).max():.4g}")
  losses = {p: [m["train_loss"] for m in r.metrics] for p, r in runs.items()}
  np.testing.assert_allclose(losses["fp16"], losses["fp32"], rtol=0.02)
