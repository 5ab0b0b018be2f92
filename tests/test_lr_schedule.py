"""The learning-rate schedule every system trains under (hetpipe_jax/optim.py ``LrSchedule``), worked by hand on a
HetPipe stage (its local updates, also under 2BW's accumulation), on the peers' trainer (a synchronous step, each
local-SGD worker's own inner steps), the study's horizon floor, and the gradient noise scale against numpy."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, read_trace, run_hetpipe, synthetic
from hetpipe_jax.baselines.numerics import train_sgd
from hetpipe_jax.core.controls import parse_control
from hetpipe_jax.data import Dataset, WorkerStreams
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.optim import CONSTANT, make_optimizer, parse_lr_schedule
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions
from hetpipe_jax.studies.convergence_config import ConvergenceConfig
from hetpipe_jax.studies.convergence_study import horizon
from hetpipe_jax.studies.noise_scale import gradient_noise_scale

from helpers import assert_trace_ok

LR = 0.1
LINEAR = LayeredModel("linear", (nn.Dense(1, use_bias=False),), ("dense",), loss=lambda y, labels: jnp.mean(y))


def test_the_cosine_schedule_worked_by_hand():
  # 10 updates, warm-up 0.2 of them (2): 1/2, 1 (the peak), then the cosine from 1 at update 2 to 0.1 at update 10
  s = parse_lr_schedule("cosine:warmup=0.2,final=0.1")
  cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * (t - 2) / 8)) / 2 for t in range(2, 11)]
  assert [float(s.factor(u, 10)) for u in range(10)] == pytest.approx([0.5] + cosine, rel=1e-6)
  # no warm-up: the first update at the peak, the last at the final factor
  s = parse_lr_schedule("cosine:warmup=0,final=0")
  assert float(s.factor(0, 5)) == 1.0 and float(s.factor(4, 5)) == pytest.approx(0.0, abs=1e-7)
  assert parse_lr_schedule("cosine") == (0.05, 0.1) and str(parse_lr_schedule("cosine")) == (
      "cosine:warmup=0.05,final=0.1")


def test_constant_is_the_rate_itself_so_runs_without_a_schedule_are_unchanged():
  assert parse_lr_schedule("constant") is CONSTANT and CONSTANT.rate(0.3, 100) == 0.3
  assert isinstance(parse_lr_schedule("cosine").rate(0.3, 100), type(lambda: 0))


@pytest.mark.parametrize("spec, message", [
    ("linear", "give constant or cosine"), ("cosine:warmup=1", "warmup=1, final=0.1"),
    ("cosine:final=2", "final=2"), ("cosine:warmup=0.1,warmup=0.2", "given twice"),
    ("cosine:decay=0.5", "'decay' is unknown"), ("cosine:warmup=x", "is not KEY=NUMBER")])
def test_a_bad_schedule_is_refused_in_one_line(spec, message):
  with pytest.raises(ConfigError, match=message) as e:
    parse_lr_schedule(spec)
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match=message):
    RunConfig.of(lr_schedule=spec).validate()


@pytest.mark.parametrize("control, k", [("per_minibatch", 1), ("2bw:k=2", 2)])
def test_a_stage_scales_each_local_update_by_the_schedule_of_its_updates(control, k):
  # loss = p x sum(w) for minibatch p: its gradient is p in every weight; 4 minibatches are 4 / K local updates
  schedule = parse_lr_schedule("cosine:warmup=0.5,final=0")
  updates = 4 // k
  tx = make_optimizer("sgd", schedule.rate(LR, updates))
  stage = Stage(LINEAR, range(0, 1), ({"kernel": jnp.ones((3, 1), jnp.float32)},), jax.devices()[0], tx, 4,
                StageOptions(control=parse_control(control)))
  for p in (1, 2, 3, 4):
    stage.forward(p, jnp.full((2, 3), float(p), jnp.float32), None)
  for p in (1, 2, 3, 4):
    stage.backward(p, None)
  grads = [np.mean([1, 2, 3, 4][i * k:(i + 1) * k]) for i in range(updates)]  # each update's (mean) gradient
  expected = 1.0 - sum(LR * float(schedule.factor(u, updates)) * g for u, g in enumerate(grads))
  assert float(stage.params[0]["kernel"][0, 0]) == pytest.approx(expected, rel=1e-6)
  assert expected != pytest.approx(1.0 - LR * sum(grads))  # (the schedule made a difference)


def _data(n: int = 64, seed: int = 0) -> Dataset:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32) + 0.5
  y = np.zeros(n, np.int32)
  return Dataset("linear", x, y, x[:8], y[:8], 2)


def test_a_synchronous_step_and_each_local_worker_take_the_schedule_of_their_own_updates():
  # loss mean(x @ w): a batch's gradient is its mean input, whatever w, so the weights follow by hand
  model, data = LINEAR, _data()
  schedule = parse_lr_schedule("cosine:warmup=0.25,final=0.2")
  w0 = np.asarray(model.init(jax.random.key(0), jnp.asarray(data.x_train[:8]))[0]["kernel"])[:, 0]
  streams = WorkerStreams(data, [8], 0)
  result = train_sgd(model=model, dataset=data, tx=make_optimizer("sgd", schedule.rate(LR, 4)), batch_sizes=[8],
                     rounds=4, round_seconds=1.0, seed=0)
  expected = w0 - sum(LR * float(schedule.factor(s - 1, 4)) * streams(0, s)[0].mean(0) for s in range(1, 5))
  np.testing.assert_allclose(np.asarray(result.params[0]["kernel"])[:, 0], expected, rtol=1e-5)
  # local SGD, workers of H 1 and 3 for 2 rounds: each takes its own transformation over its 2 x H inner steps;
  # the round adds the example-weighted mean of their changes (the default outer step)
  hs, sizes = (1, 3), [4, 4]
  txs = [make_optimizer("sgd", schedule.rate(LR, 2 * h)) for h in hs]
  local = train_sgd(model=model, dataset=data, tx=txs, batch_sizes=sizes, rounds=2, round_seconds=1.0,
                    local_steps=list(hs), seed=0)
  streams, w = WorkerStreams(data, sizes, 0, list(hs)), w0
  for r in (1, 2):
    deltas = [-sum(LR * float(schedule.factor((r - 1) * h + k - 1, 2 * h)) * streams(i, r, k)[0].mean(0)
                   for k in range(1, h + 1)) for i, h in enumerate(hs)]
    w = w + sum(h * b * d for h, b, d in zip(hs, sizes, deltas)) / sum(h * b for h, b in zip(hs, sizes))
  np.testing.assert_allclose(np.asarray(local.params[0]["kernel"])[:, 0], w, rtol=1e-5)
  with pytest.raises(ConfigError, match="1 optimizers for 2 workers"):
    train_sgd(model=model, dataset=data, tx=txs[:1], batch_sizes=[4, 4], rounds=1, round_seconds=1.0,
              local_steps=[1, 1])


def test_the_horizon_floor_gives_the_largest_batch_its_updates_and_never_shortens_a_run():
  config = ConvergenceConfig(get_cluster("paper_mini"), epochs=1.0, min_updates=200)
  assert horizon(config, {"horovod": 512, "hetpipe": 32}, 10_000) == pytest.approx(200 * 512 / 10_000)
  assert horizon(config, {"hetpipe": 8}, 10_000) == 1.0
  with pytest.raises(ConfigError, match="--min_updates=-1"):
    ConvergenceConfig(get_cluster("paper_mini"), min_updates=-1)


def test_the_gradient_noise_scale_is_mcCandlishs_unbiased_estimate():
  # per-example loss mean(x @ w): its gradient is x itself, whatever the weights
  data = _data(96, seed=3)
  params = LINEAR.init(jax.random.key(0), jnp.asarray(data.x_train[:1]))
  got = gradient_noise_scale(LINEAR, params, data, examples=96, chunk=32)
  g = data.x_train.astype(np.float64)
  n, big, mean_sq = len(g), float(np.sum(g.mean(0) ** 2)), float(np.mean(np.sum(g * g, 1)))
  grad_sq, trace = (n * big - mean_sq) / (n - 1), (mean_sq - big) / (1 - 1 / n)
  assert got.grad_norm_sq == pytest.approx(grad_sq, rel=1e-4) and got.trace_cov == pytest.approx(trace, rel=1e-4)
  # the trace is the per-coordinate sample variance's sum: an independent check of the formula
  assert got.trace_cov == pytest.approx(float(np.sum(np.var(g, 0, ddof=1))), rel=1e-4)
  assert got.b_simple == pytest.approx(trace / grad_sq, rel=1e-4)
  with pytest.raises(ConfigError, match="2..96 training examples"):
    gradient_noise_scale(LINEAR, params, data, examples=97)


def test_a_scheduled_run_records_its_schedule_and_passes_the_checker(tmp_path):
  model, data = get_model("mlp", 10), synthetic(256, 64)
  trace = str(tmp_path / "t.jsonl")
  config = RunConfig.of(num_vws=2, stages=(2, 2), nm=(2, 2), waves=4, batch_size=16, executor="virtual",
                        lr_schedule="cosine:warmup=0.1,final=0.1", trace_path=trace, staleness="2bw:k=2")
  result = run_hetpipe(model, data, config)
  assert result.events[0]["lr_schedule"] == "cosine:warmup=0.1,final=0.1"
  assert_trace_ok(read_trace(trace))
  with pytest.raises(ConfigError, match="beside tx"):
    RunConfig.of(lr_schedule="cosine", tx=optax.sgd(0.1)).validate()
