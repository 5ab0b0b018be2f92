"""Reliability (issue 10): non-finite updates are refused, bad values are config errors, and the sim
executor simulates a full-size model without data."""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpipe_jax import ConfigError, ParameterServer, RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.errors import NonFiniteUpdate
from hetpipe_jax.models import FULL_SIZE, full_size_model

from helpers import assert_trace_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params():
  return ({"w": jnp.zeros((3, 2))}, {"b": jnp.ones(4)})


def _update(w, b):
  return {0: {"w": jnp.full((3, 2), w)}, 1: {"b": jnp.full(4, b)}}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_push_stops_before_it_touches_the_weights(bad):
  ps = ParameterServer(_params(), num_vws=2, d=0)
  ps.push(0, 0, _update(1.0, 1.0))
  with pytest.raises(NonFiniteUpdate, match=r"VW 1 pushed a non-finite update .* wave 0, units \[1\]") as e:
    ps.push(1, 0, _update(1.0, bad))
  assert (e.value.vw, e.value.wave, e.value.units, e.value.clock) == (1, 0, [1], 0)
  assert ps.clock.c_local == (1, 0)  # nothing changed: not the clock, not the weights
  np.testing.assert_array_equal(ps.params[0]["w"], 1.0)
  np.testing.assert_array_equal(ps.params[1]["b"], 2.0)


def test_skip_drops_the_wave_and_ticks_the_clock():
  ps = ParameterServer(_params(), num_vws=1, d=0, on_nonfinite="skip")
  ps.push(0, 0, _update(float("nan"), 1.0))
  ps.push(0, 1, _update(1.0, 1.0))
  assert ps.clock.c_local == (2,) and ps.dropped == {(0, 0): [0]}
  np.testing.assert_array_equal(ps.params[0]["w"], 1.0)  # only wave 1 was applied
  np.testing.assert_array_equal(ps.params[1]["b"], 2.0)


def test_a_diverging_run_stops_with_one_line_naming_vw_wave_stage_unit_and_clock():
  config = RunConfig.of(cluster="uniform8", num_vws=2, stages=2, nm=2, d=1, waves=10, learning_rate=1e8)
  with pytest.raises(NonFiniteUpdate) as e:
    run_hetpipe(get_model("mlp"), synthetic(), config)
  message = str(e.value)
  assert "\n" not in message
  for part in (f"VW {e.value.vw} ", f"wave {e.value.wave}", "stage ", "unit ",
               f"global clock {e.value.clock}, the last good one", "on_nonfinite='skip'"):
    assert part in message, message


def test_a_diverging_run_with_skip_goes_on_and_its_weights_stay_finite(tmp_path):
  config = RunConfig.of(cluster="uniform8", num_vws=2, stages=2, nm=2, d=1, waves=10, learning_rate=1e8,
                     on_nonfinite="skip", trace_path=str(tmp_path / "t.jsonl"))
  result = run_hetpipe(get_model("mlp"), synthetic(), config)
  assert_trace_ok(result.events)
  dropped = [e for e in result.events if e["ev"] == "push" and e.get("dropped") == "nonfinite"]
  assert dropped and all(e["units"] for e in dropped)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(result.params))
  assert sum(e["ev"] == "push" for e in result.events) == 2 * 10  # every wave still counted


@pytest.mark.parametrize("field,value,message", [
    ("learning_rate", float("nan"), "learning_rate=nan; use a finite learning rate > 0"),
    ("learning_rate", 0.0, "learning_rate=0.0; use a finite learning rate > 0"),
    ("learning_rate", -0.1, "learning_rate=-0.1; use a finite learning rate > 0"),
    ("learning_rate", float("inf"), "learning_rate=inf; use a finite learning rate > 0"),
    ("seed", -5, "seed=-5; use a seed in [0, 2**63 - 1]"),
    ("time_scale", float("nan"), "time_scale=nan"),
    ("on_nonfinite", "ignore", "unknown on_nonfinite 'ignore'; choose one of stop, skip"),
])
def test_bad_values_are_config_errors(field, value, message):
  with pytest.raises(ConfigError, match=r"^" + message.replace("[", r"\[").replace("*", r"\*")):
    run_hetpipe(get_model("mlp"), synthetic(), RunConfig.of(cluster="uniform8", waves=1, **{field: value}))


def test_a_model_that_cannot_take_the_input_is_a_config_error():
  with pytest.raises(ConfigError, match=r"model 'vgg_E' cannot take synthetic's .* inputs .* vgg19 is a "
                                        r"full-size model for 224x224x3 inputs: simulate it without data"):
    run_hetpipe(full_size_model("vgg19"), synthetic(), RunConfig.of(cluster="uniform8", waves=1))


def test_the_sim_executor_simulates_a_full_size_model_without_data():
  result = run_hetpipe(full_size_model("vgg19"), FULL_SIZE["vgg19"],
                       RunConfig.of(cluster="paper_testbed", policy="HD", waves=3, executor="sim"))
  assert_trace_ok(result.events)
  assert result.events[0]["dataset"].startswith("none (input 224x224x3")
  assert math.isfinite(result.images_per_second) and result.images_per_second > 0
  with pytest.raises(ConfigError, match="trains on data, but the run has only an input shape"):
    run_hetpipe(full_size_model("vgg19"), FULL_SIZE["vgg19"], RunConfig.of(cluster="paper_testbed", waves=1))


@pytest.mark.parametrize("flags,message", [
    (["--learning_rate=nan"], "error: learning_rate=nan; use a finite learning rate > 0"),
    (["--model=vgg19"], "error: model 'vgg_E' cannot take"),
    (["--out_dir=/dev/null/out"], "error: --out_dir=/dev/null/out: /dev/null/out is not a writable directory (Not a "
                                  "directory); choose another --out_dir"),
])
def test_the_cli_turns_bad_input_into_one_line(tmp_path, flags, message):
  proc = subprocess.run([sys.executable, "-m", "experiments.train", "--waves=2", "--dataset=synthetic",
                         *([] if any(f.startswith("--out_dir") for f in flags) else [f"--out_dir={tmp_path}"]),
                         *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
      next(line for line in proc.stderr.splitlines() if line.startswith(message))]


@pytest.mark.parametrize("script,flag", [("plan", "--out=/dev/null/p/plan.json"),
                                         pytest.param("convergence", "--out_dir=/dev/null/study",
                                                      marks=pytest.mark.slow)])
def test_an_unwritable_output_is_refused_before_the_work(script, flag):
  # (a plan of ResNet-152 takes minutes, a study an hour: neither starts before its outputs can be written)
  proc = subprocess.run([sys.executable, "-m", f"experiments.{script}", "--model=resnet152" if script == "plan"
                         else "--epochs=1", flag], capture_output=True, text=True, timeout=120, cwd=ROOT)
  name, value = flag[2:].split("=")
  folder = "/dev/null/p" if script == "plan" else value
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"error: --{name}={value}: {folder} is not a writable directory (Not a directory); choose another --{name}")
  assert "Traceback" not in proc.stderr and "training" not in proc.stderr and not proc.stdout


def test_the_cli_simulates_vgg19(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.train", "--executor=sim", "--model=vgg19",
                         "--cluster=paper_testbed", "--policy=HD", "--waves=3", f"--out_dir={tmp_path}"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "trace check: OK" in proc.stdout
