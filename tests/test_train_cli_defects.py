"""The training CLI's settings declared once (experiments/run_flags.py generates the flags from RunConfig's fields),
and the defects a new user met: the logged config is the run's, a refused run leaves no folder, a seed reaches
every unit, a language model reports tokens and perplexity against the unigram baseline."""

import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx
from matplotlib.figure import Figure

from experiments import run_flags
from hetpipe_jax import ConfigError, RunConfig, from_module, from_modules, get_model, run_hetpipe, synthetic
from hetpipe_jax.data import Dataset
from hetpipe_jax.evaluate import language_score
from hetpipe_jax.models import full_size_spec
from hetpipe_jax.run.config import settings
from hetpipe_jax.run.result import ran_config
from hetpipe_jax.viz import training

from helpers import assert_trace_ok, train_cli


def parsed(*argv: str, names=None, overrides=None) -> flags.FlagValues:
  """The run's flags defined on their own FlagValues, parsed from ``argv``."""
  fv = flags.FlagValues()
  run_flags.define(names, overrides, flag_values=fv)
  fv(["train", *argv])
  return fv


# --- every setting declared once ------------------------------------------------------------------------------


def test_every_config_setting_is_a_flag_with_its_declared_default_and_help():
  fv = parsed()
  for setting in settings():
    flag = fv[run_flags.flag_name(setting.name)]
    assert setting.help[:40] in flag.help, setting.name  # (absl puts an enum's choices first)
    value, spelled = flag.value, run_flags.spelling(setting)
    if spelled.kind == "list" and value is not None:
      value = [int(v) for v in value][0]  # --stages=2 for stages=2
    elif spelled.parse is not None and spelled.kind != "multi_string":
      value = spelled.parse(value)  # --tp=1 (a number or auto) for tp=1
    repeated = spelled.kind == "multi_string"  # (--fail, --slow: a list of what each one says)
    assert value == (list(setting.default) if repeated else setting.default), setting.name
  default = run_flags.run_config(fv, **run_flags.layout(fv))
  assert default.replace(failures=tuple(default.faults.failures), slow=tuple(default.faults.slow)) == RunConfig()


def test_flags_parse_lists_cuts_and_failures_into_the_config():
  fv = parsed("--num_vws=2", "--stages=2,1", "--nm=3,2", "--cuts=0,1,5;0,5", "--fail=1@4", "--fail=0@2",
              "--optimizer=adam", "--checkpoint_every=7", "--fast_sim", "--on_nonfinite=skip", "--waves=9")
  config = run_flags.run_config(fv, **run_flags.layout(fv), trace_path="t.jsonl")
  assert config.layout.stages == [2, 1] and config.layout.nm == [3, 2]
  assert config.layout.cuts == [[0, 1, 5], [0, 5]]
  assert config.faults.failures == [(1, 4), (0, 2)] and config.optim.name == "adam"
  assert (config.checkpoint.every, config.sim.fast, config.optim.on_nonfinite, config.waves) == (7, True, "skip", 9)
  assert config.trace_path == "t.jsonl" and run_flags.devices(config) == 4
  policy = parsed("--policy=ED")
  assert run_flags.layout(policy)["nm"] == "max_fit"  # a policy's planner picks Nm unless told


def test_a_study_defines_a_subset_with_its_own_default_stated():
  fv = parsed(names=["batch_size", "optimizer"], overrides={"optimizer": "momentum"})
  assert "waves" not in fv and fv.optimizer == "momentum"
  config = run_flags.run_config(fv)
  assert config.optim.name == "momentum" and config.waves == RunConfig().waves  # not a flag: the declared default
  with pytest.raises(ValueError, match="unknown settings"):
    run_flags.define(["batch_sise"], flag_values=flags.FlagValues())
  with pytest.raises(ValueError, match="overrides"):
    run_flags.define(["batch_size"], {"optimizer": "sgd"}, flag_values=flags.FlagValues())


@pytest.mark.parametrize("argv, message", [
    (["--fail=1-4"], r"--fail=1-4; write VW@WAVE"),
    (["--stages=two"], r"--stages=two must be integers"),
    (["--policy=ED", "--num_vws=2"], r"--policy=ED lets the planner choose .* drop --num_vws"),
    (["--policy=ED", "--nm=2,3"], r"gives one Nm per virtual worker"),
])
def test_bad_flags_are_one_config_error(argv, message):
  fv = parsed(*argv)
  with pytest.raises(ConfigError, match=message):
    run_flags.run_config(fv, **run_flags.layout(fv))


# --- the logged config is the run's -------------------------------------------------------------------------


def test_the_config_that_ran_has_the_planners_layout():
  config = RunConfig.of(policy="ED", executor="sim", waves=2)
  result = run_hetpipe(get_model("mlp"), synthetic(num_train=256, num_test=64), config)
  ran = ran_config(config, result)
  meta = result.events[0]
  assert ran.layout.num_vws == len(meta["stages"]) != config.layout.num_vws  # ED on hetero4: 2, not the default 3
  assert list(ran.layout.nm) == meta["nm"] and [list(c) for c in ran.layout.cuts] == result.cuts
  again = run_hetpipe(get_model("mlp"), synthetic(num_train=256, num_test=64), ran)  # an explicit layout: the same
  assert again.events[0]["gpus"] == meta["gpus"] and again.cuts == result.cuts


# --- a refused run leaves no folder --------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--policy=ED", "--num_vws=2"],  # refused reading the flags
    ["--dataset=synthetic", "--model=mlp", "--batch_size=5000"],  # refused laying the run out (batch > data)
])
def test_a_refused_run_creates_no_output_folder(tmp_path, argv):
  out = tmp_path / "out" / "run"
  proc = train_cli(out, *argv, "--waves=1", timeout=300)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr[-2000:]
  assert not (tmp_path / "out").exists()


# --- a seed reaches every unit ------------------------------------------------------------------------------


class Flatten(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(64)(x.reshape(x.shape[0], -1))


def mixed_model():
  """A linen unit, an NNX unit built from the seed and a built NNX unit (which keeps its own parameters)."""
  return from_modules([nn.Dense(16), lambda rngs: nnx.Linear(16, 8, rngs=rngs), nnx.Linear(8, 4, rngs=nnx.Rngs(0))],
                      input_shape=(6,), names=["linen", "seeded", "built"])


def test_a_seed_reaches_every_unit_that_is_not_given_built():
  model = mixed_model()
  x = jnp.ones((2, 6))
  p0, p0_again, p1 = (model.init(jax.random.key(seed), x) for seed in (0, 0, 1))
  jax.tree.map(np.testing.assert_array_equal, p0, p0_again)  # the same seed: the same weights
  assert not np.allclose(p0[0]["kernel"], p1[0]["kernel"])  # linen
  assert not np.allclose(p0[1]["kernel"], p1[1]["kernel"])  # NNX, built from the seed
  np.testing.assert_array_equal(p0[2]["kernel"], p1[2]["kernel"])  # NNX given built: its own
  seeded_from = nnx.Linear(16, 8, rngs=nnx.Rngs(jax.random.split(jax.random.key(1), 3)[1]))
  np.testing.assert_array_equal(p1[1]["kernel"], seeded_from.kernel[...])  # exactly its unit's key


def test_one_nnx_sequential_built_from_rngs_is_cut_into_seeded_units():
  model = from_module(lambda rngs: nnx.Sequential(nnx.Linear(6, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 4, rngs=rngs)),
                      ["linear2"], input_shape=(6,))
  assert model.unit_names == ("linear0", "linear2")
  x = jnp.ones((2, 6))
  p0, p0_again, p1 = (model.init(jax.random.key(seed), x) for seed in (0, 0, 1))
  jax.tree.map(np.testing.assert_array_equal, p0, p0_again)
  assert not np.allclose(p0[0]["layers/0/kernel"], p1[0]["layers/0/kernel"])
  assert not np.allclose(p0[1]["kernel"], p1[1]["kernel"])
  assert model.apply(p1, x).shape == (2, 4)


def test_a_seed_that_cannot_reach_a_built_nnx_unit_is_refused():
  data = synthetic(num_train=64, num_test=16)
  model = from_modules([Flatten(), lambda rngs: nnx.Linear(64, 16, rngs=rngs), nnx.Linear(16, 10, rngs=nnx.Rngs(0))],
                       input_shape=(8, 8, 1), names=["linen", "seeded", "built"])
  with pytest.raises(ConfigError, match=r"seed=3 cannot reach unit\(s\) built of model 'custom'"):
    run_hetpipe(model, data, RunConfig.of(num_vws=1, stages=1, nm=1, waves=1, executor="sim", seed=3))
  with pytest.raises(ConfigError, match=r"unit 'relu0' is a custom_jvp, not a Flax module nor a function of rngs"):
    from_modules([jax.nn.relu], input_shape=(4,), names=["relu0"])


def test_the_seed_flag_changes_an_nnx_units_initial_weights():
  model = get_model("examples.residual_mlp:model")  # NNX blocks given as functions of rngs
  x = jnp.ones((2, 8, 8, 1))
  p0, p1 = model.init(jax.random.key(0), x), model.init(jax.random.key(1), x)
  assert not np.allclose(p0[1]["up/kernel"], p1[1]["up/kernel"])


# --- a language model reports tokens and perplexity ---------------------------------------------------------


@pytest.mark.slow  # (10-28 s: the README's test command keeps under 10 minutes; .ci/run runs it)
def test_a_language_runs_summary_and_lines_say_tokens_and_perplexity(tmp_path):
  proc = train_cli(tmp_path, "--model=gpt", "--dataset=tokens", "--optimizer=adam", "--learning_rate=0.003",
                   "--waves=2", "--num_vws=2", "--eval_every=2", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert "images_per_second" not in summary and "final_test_accuracy" not in summary
  assert summary["token_unit"] == "tokens"
  seconds = summary["seconds"]
  pushed = sum(1 for line in (tmp_path / "trace.jsonl").read_text().splitlines() if '"ev":"push"' in line)
  assert summary["tokens_per_second"] == pytest.approx(pushed * 2 * 32 * 16 / seconds)  # Nm 2, batch 32, 16 tokens
  assert summary["perplexity"] == pytest.approx(math.exp(summary["final_test_loss"]))
  assert summary["unigram_perplexity"] == pytest.approx(math.exp(summary["unigram_test_loss"]))
  first = proc.stdout.splitlines()[0]
  assert "tokens/s" in first and "final test perplexity" in first and "images/s" not in proc.stdout
  assert "accuracy" not in proc.stdout and "nats per token" in proc.stdout
  assert_trace_ok([json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()])
  assert os.path.getsize(tmp_path / "training.png") > 0


def test_bytes_are_named_and_an_image_model_is_no_language_model():
  tokens = np.zeros((4, 3), np.int32)
  score = language_score(Dataset("text", tokens, tokens, tokens, tokens, 256), 1.0)
  assert score is not None and score.unit == "bytes" and score.tokens_per_example == 3
  assert language_score(synthetic(num_train=8, num_test=4), 1.0) is None
  sim = language_score(full_size_spec("gpt2-xl", 128), None)
  assert sim is not None and (sim.unit, sim.tokens_per_example, sim.perplexity) == ("tokens", 128, None)


def test_a_language_models_plot_is_perplexity_against_the_unigram_baseline():
  rows = [{"vw": 0, "time": 1.0, "train_loss": 3.0}, {"vw": 0, "time": 2.0, "train_loss": 2.0, "test_loss": 2.0,
                                                       "test_accuracy": 0.3}]
  tokens = np.array([[0, 0, 0, 1]])
  score = language_score(Dataset("tokens", tokens, tokens, tokens, tokens, 2), 2.0)
  assert score is not None
  ax = Figure().subplots()
  training._perplexity_panel(ax, rows, score)  # pylint: disable=protected-access
  curve, baseline = ax.get_lines()
  assert list(curve.get_ydata()) == pytest.approx([math.exp(2.0)])
  assert list(baseline.get_ydata()) == pytest.approx([score.unigram_perplexity] * 2)
