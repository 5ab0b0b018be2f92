"""Bring your own model: Flax linen and NNX modules as a cuttable model, trained, profiled, planned and
simulated like the built-in ones (examples/residual_mlp.py is the user's model)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples import residual_mlp
from experiments import common
from hetpipe_jax import (
  ConfigError,
  MinibatchStreams,
  RunConfig,
  from_module,
  from_modules,
  get_cluster,
  get_model,
  read_trace,
  run_hetpipe,
  synthetic,
)
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.models import num_params
from hetpipe_jax.plan.allocation import plan_cluster

from helpers import TWO_NODES, assert_trace_ok, train_cli

DATA = synthetic(num_train=512, num_test=128)
X = jnp.asarray(DATA.x_train[:4])


class Flatten(nn.Module):
  width: int = 16

  @nn.compact
  def __call__(self, x):
    return nn.relu(nn.Dense(self.width)(x.reshape(x.shape[0], -1)))


def small() -> object:
  return residual_mlp.model(width=16, blocks=2)


# --- the constructor -------------------------------------------------------------------------------------

def test_linen_units_are_initialised_from_the_seed():
  model = from_modules([Flatten(), nn.Dense(10)], input_shape=(8, 8, 1), names=["a", "b"])
  assert model.unit_names == ("a", "b") and model.num_units == 2 and model.input_spec.shape == (8, 8, 1)
  p0, p1 = model.init(jax.random.key(0), X), model.init(jax.random.key(1), X)
  assert jax.tree.map(jnp.shape, p0) == ({"Dense_0": {"bias": (16,), "kernel": (64, 16)}},
                                         {"bias": (10,), "kernel": (16, 10)})
  assert not np.allclose(p0[1]["kernel"], p1[1]["kernel"])
  assert model.apply(p0, X).shape == (4, 10)


def test_nnx_units_start_from_their_own_parameters_and_compute_as_themselves():
  hidden = nnx.Sequential(nnx.Linear(64, 16, rngs=nnx.Rngs(3)), nnx.relu)
  head = nnx.Linear(16, 10, rngs=nnx.Rngs(4))
  model = from_modules([Flatten(64), hidden, head], input_shape=(8, 8, 1))
  assert model.unit_names == ("flatten0", "sequential1", "linear2")
  params = model.init(jax.random.key(0), X)
  assert set(params[2]) == {"kernel", "bias"}  # a plain dict of arrays: what the PS and optimizers see
  np.testing.assert_array_equal(params[2]["kernel"], head.kernel[...])
  np.testing.assert_array_equal(params[1]["layers/0/kernel"], hidden.layers[0].kernel[...])
  np.testing.assert_array_equal(model.init(jax.random.key(7), X)[2]["kernel"], head.kernel[...])  # built: its own
  h = model.apply(params[:1], X, 0, 1)
  np.testing.assert_allclose(model.apply(params[1:], h, 1), head(hidden(h)), rtol=1e-6)
  # a gradient step through the pure function reaches the NNX parameters
  grads = jax.grad(lambda p: model.loss(model.apply(p, X), jnp.arange(4)))(params)
  assert float(jnp.abs(grads[1]["layers/0/kernel"]).sum()) > 0


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_one_sequential_is_cut_at_named_layers(kind):
  if kind == "linen":
    net = nn.Sequential([Flatten(32, name="stem"), nn.Dense(32, name="mid"), nn.relu, nn.Dense(10, name="out")])
  else:
    rngs = nnx.Rngs(0)
    net = nnx.Sequential(nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs), nnx.relu,
                         nnx.Linear(32, 10, rngs=rngs))
  first, last = ("mid", "out") if kind == "linen" else ("linear1", 3)
  model = from_module(net, cut_points=[first, last], input_shape=(64,) if kind == "nnx" else (8, 8, 1))
  assert model.num_units == 3
  assert model.unit_names == (("stem", "mid", "out") if kind == "linen" else ("linear0", "linear1", "linear3"))
  x = X if kind == "linen" else X.reshape(4, -1)
  params = model.init(jax.random.key(0), x)
  if kind == "linen":  # the units compose to the Sequential on the same parameters
    whole = {"layers_0": params[0], "layers_1": params[1]["layers_0"], "layers_3": params[2]}
    expected = net.apply({"params": whole}, x)
  else:
    expected = net(x)
  np.testing.assert_allclose(model.apply(params, x), expected, rtol=1e-5, atol=1e-6)
  assert from_module(net, input_shape=(8, 8, 1) if kind == "linen" else (64,), cut_points=[1, 3]).num_units == 3


BAD = [
    (lambda: from_modules([], input_shape=(4,)), "non-empty list of Flax modules"),
    (lambda: from_modules([nn.Dense(4), jnp.tanh], input_shape=(4,)),
     "unit 'pjitfunction1' is a PjitFunction, not a Flax module nor a function of rngs"),
    (lambda: from_modules([nn.Dense(4)], input_shape=(0, 4)), "input_shape=(0, 4)"),
    (lambda: from_modules([nn.Dense(4)], input_shape=(4,), input_dtype="float99"), "input_dtype='float99'"),
    (lambda: from_modules([nn.Dense(4)], input_shape=(4,), names=["a", "b"]), "name each of the 1 units"),
    (lambda: from_modules([nn.Dense(4), nn.Dense(4)], input_shape=(4,), names=["a", "a"]), "repeat a name"),
    (lambda: from_modules([nn.Dense(4)], input_shape=(4,), loss=3), "loss=3 is not callable"),
    (lambda: from_modules([nnx.Linear(5, 4, rngs=nnx.Rngs(0))], input_shape=(4,)), "cannot take the input (4,)"),
    (lambda: from_modules([nn.Dense(4), nn.BatchNorm(use_running_average=False)], input_shape=(4,)),
     "keeps mutable state (batch_stats)"),
    (lambda: from_modules([nnx.BatchNorm(4, rngs=nnx.Rngs(0))], input_shape=(4,)), "BatchStat at mean"),
    (lambda: from_modules([nnx.Dropout(0.1, rngs=nnx.Rngs(0))], input_shape=(4,)), "RngKey at rngs/"),
    (lambda: from_module(nn.Dense(4), input_shape=(4,)), "from_module cuts a flax.linen.Sequential"),
    (lambda: from_module(nn.Sequential([nn.Dense(4), nn.relu]), input_shape=(4,)), "unit 'relu1' has no param"),
    (lambda: from_module(nn.Sequential([nn.Dense(4), nn.Dense(4)]), [5], input_shape=(4,)), "cut point 5 is not"),
    (lambda: from_module(nn.Sequential([nn.Dense(4), nn.Dense(4)]), [0], input_shape=(4,)), "increasing order"),
    (lambda: get_model("examples.residual_mlp"), "unknown model"),
    (lambda: get_model("no_such_pkg.mod:model"), "module 'no_such_pkg.mod' cannot be imported"),
    (lambda: get_model("examples.residual_mlp:nope"), "has no 'nope'"),
    (lambda: get_model("examples.residual_mlp:Stem"), "Stem() failed (TypeError: "),
    (lambda: get_model("collections:OrderedDict"), "OrderedDict() returned a OrderedDict"),
    (lambda: get_model("examples.residual_mlp:1x"), "is not package.module:factory"),
]


@pytest.mark.parametrize("build,message", BAD, ids=[m for _, m in BAD])
def test_bad_models_are_one_line(build, message):
  with pytest.raises(ConfigError) as e:
    build()
  assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_that_does_not_fit_the_data_is_refused_before_the_run():
  config = RunConfig.of(num_vws=1, stages=1, nm=1, d=0, waves=1)
  cases = [
      (from_modules([Flatten(), nn.Dense(10)], input_shape=(64,)), "build the model with input_shape=(8, 8, 1)"),
      (from_modules([Flatten(), nn.Dense(5)], input_shape=(8, 8, 1)), "outputs 5 scores per example"),
      (from_modules([Flatten(), nn.Dense(10)], input_shape=(8, 8, 1), loss=lambda y, t: (y - 1.0) ** 2),
       "returns (32, 10) float32; it must return the mean loss"),
  ]
  for model, message in cases:
    with pytest.raises(ConfigError, match=r"^[^\n]*" + message.replace("(", r"\(").replace(")", r"\)")):
      run_hetpipe(model, DATA, config)


# --- training, profiling, planning, simulating -----------------------------------------------------------

@pytest.mark.slow
def test_one_vw_nm1_is_plain_sgd_with_the_models_own_loss():
  """Transparency on a brought model with its own loss (label smoothing): the pipeline's losses are those
  of a plain single-device loop on ``model.loss``."""
  def smoothed(logits, labels):
    return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.1)).mean()

  model = residual_mlp.model(width=16, blocks=2)
  model = from_modules([Flatten(16), *model.units[1:]], input_shape=(8, 8, 1), loss=smoothed, name="smoothed")
  steps, tx = 8, optax.sgd(0.1)
  batches = MinibatchStreams(DATA, 32, num_vws=1, seed=1)
  params = model.init(jax.random.key(1), DATA.x_train[:32])
  step = jax.jit(jax.value_and_grad(lambda p, x, y: smoothed(model.apply(p, x), y)))
  losses = []
  for p in range(1, steps + 1):
    loss, grads = step(params, *batches(0, p))
    params = optax.apply_updates(params, tx.update(grads, tx.init(params))[0])
    losses.append(float(loss))
  result = run_hetpipe(model, DATA, RunConfig.of(cluster="uniform8", num_vws=1, stages=3, nm=1, d=0, waves=steps,
                                                 seed=1, tx=tx, eval_every=steps))
  assert_trace_ok(result.events)
  np.testing.assert_allclose([r["train_loss"] for r in result.metrics], losses, rtol=1e-5)
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("executor", ["virtual", "wall"])
@pytest.mark.slow
def test_a_brought_model_trains_under_wsp(executor):
  model = small()
  result = run_hetpipe(model, DATA, RunConfig.of(num_vws=2, stages=2, nm=2, d=1, waves=10, executor=executor))
  stats = assert_trace_ok(result.events)
  meta = result.events[0]
  assert meta["model"] == "residual_mlp" and meta["executor"] == executor and meta["stages"] == [2, 2]
  assert max(stats["local_staleness"]) <= 1  # Nm - 1
  assert result.metrics[-1]["train_loss"] < 0.5 * result.metrics[0]["train_loss"]
  assert result.metrics[-1]["test_accuracy"] > 0.5
  assert jax.tree.structure(result.params) == jax.tree.structure(model.init(jax.random.key(0), X))


def test_a_brought_model_is_profiled_planned_and_simulated_without_data():
  model = small()
  profiles = profile_units(model, model.sample_input(32))
  assert [p.name for p in profiles] == ["stem", "block0", "block1", "head"]
  params = model.init(jax.random.key(0), X)
  assert [p.param_bytes for p in profiles] == [4 * num_params(p) for p in params]
  assert all(p.fwd_flops > 0 and p.bwd_flops > p.fwd_flops for p in profiles)
  plan = plan_cluster(get_cluster("hetero4"), profiles, "ED")
  assert plan.layout.num_vws > 0 and all(c[-1] == model.num_units for c in plan.layout.cuts)
  # what the plan, tune and throughput commands profile for --model=package.module:factory: its input spec
  named, per_example, unit = common.model_profiles("examples.residual_mlp:model", 32)
  assert (len(named), per_example, unit) == (6, 1, "images") and named[1].name == "block0"
  result = run_hetpipe(model, None, RunConfig.of(policy="ED", waves=6, executor="sim"))
  assert_trace_ok(result.events)
  assert result.events[0]["dataset"] == "none (input 8x8x1, 10 classes)"
  assert result.images_per_second > 0
  with pytest.raises(ConfigError, match="trains on data, but the run has only an input shape"):
    run_hetpipe(model, None, RunConfig.of(num_vws=1, stages=1, nm=1, waves=1))


@pytest.mark.slow  # (two processes started and compiled: 40-110 s of wall time on this machine)
def test_a_brought_model_trains_across_processes(tmp_path):
  """--model=package.module:factory: every process of a multi-process run builds the user's model (the
  factory builds the same NNX parameters in each: nnx.Rngs(0))."""
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=examples.residual_mlp:model",
                   f"--cluster={TWO_NODES}", "--num_vws=1", "--stages=2", "--nm=2", "--d=0", "--waves=6")
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert events[0]["model"] == "residual_mlp" and events[0]["executor"] == "multiprocess"
  assert {e["process"] for e in events if e["ev"] in ("fwd", "bwd")} == {0, 1}  # the stages ran in both
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["model"] == "residual_mlp" and not summary["trace_violations"]
