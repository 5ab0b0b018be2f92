"""hetpipe_jax.studies.scale and .validate_fast as library calls: the scaling study on two small mixed clusters
of one-GPU nodes (8 and 16 GPUs, the 16 replicating the 8's tuned configuration) returns typed rows that survive
scale.json, and the fast mode's check re-simulates them both ways."""

import dataclasses
import json

import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.studies.scale import FIELDS, ScaleConfig, ScaleRow, model_setting, row_from_json, row_json, run_scale
from hetpipe_jax.studies.validate_fast import FastCheck, FastConfig, validate_fast, worst

SMALL = ScaleConfig(models=("resnet152",), sizes=(8, 16), per_node=1, base=8, waves=8, tune_waves=4)


@pytest.fixture(scope="module")
def rows() -> list[ScaleRow]:
  return run_scale(SMALL)


def test_the_study_returns_a_typed_row_per_size_the_larger_replicated(rows):
  assert [type(r) for r in rows] == [ScaleRow, ScaleRow] and [r.gpus for r in rows] == [8, 16]
  assert [r.nodes for r in rows] == [8, 16] and rows[1].vws == 2 * rows[0].vws  # replicated: every VW twice
  for key in ("nm", "window"):
    assert sorted(rows[1].setting[key]) == sorted(rows[0].setting[key] * 2)
  for r in rows:
    assert r.model == "resnet152" and r.setting["cluster"] == f"mixed{r.gpus}x1"
    assert r.setting["batch_size"] == 32 and r.setting["seq_len"] is None and r.setting["precision"] == "fp32"
    assert 0 < r.efficiency <= 1 + 1e-9 and r.items_per_sec == pytest.approx(r.efficiency * r.ideal_items_per_sec)
    assert r.items_per_sec in (r.items_per_sec_striped, r.items_per_sec_per_unit)  # the tuned placement's
    # (the simulations ran side by side, one per core: the row's wall may be below the sum of their seconds)
    assert r.plan_sim_seconds == r.row_seconds >= r.plan_seconds
    assert min(r.plan_seconds, r.sim_seconds, r.check_seconds) > 0 and 2 <= r.simulated_waves <= SMALL.waves


def test_simulations_one_after_another_give_what_side_by_side_gave(rows):
  """``jobs=1``: the row's simulations run in this process, one after another: the same figures, and a wall that
  holds every part."""
  (alone,) = run_scale(dataclasses.replace(SMALL, sizes=(8,), jobs=1))
  seconds = ("plan_seconds", "sim_seconds", "check_seconds", "row_seconds")
  assert alone._replace(**{f: 0.0 for f in seconds}) == rows[0]._replace(**{f: 0.0 for f in seconds})
  assert alone.row_seconds >= alone.plan_seconds + alone.sim_seconds + alone.check_seconds


def test_a_row_survives_scale_json(rows):
  docs = json.loads(json.dumps([row_json(r) for r in rows]))
  assert list(docs[0]) == [*FIELDS, "setting"]
  assert [row_from_json(d) for d in docs] == rows
  assert docs[1]["efficiency"] == rows[1].efficiency


def test_the_fast_mode_check_re_simulates_every_row_up_to_max_gpus(rows):
  checks = validate_fast(FastConfig(tuple(rows), max_gpus=8, waves=8))
  assert [type(c) for c in checks] == [FastCheck] and checks[0].gpus == 8 and checks[0].full_simulated_waves == 8
  c = checks[0]
  assert c.error == pytest.approx(c.fast_minibatches_per_sec / c.full_minibatches_per_sec - 1)
  assert abs(c.error) <= 0.02 and worst(checks) is c
  with pytest.raises(ConfigError, match=r"--max_gpus=7: no configuration of scale.json is that small"):
    validate_fast(FastConfig(tuple(rows), max_gpus=7, study="scale.json"))


@pytest.mark.parametrize("change, message", [
    ({"sizes": (12, 16)}, r"--sizes=12,16: every size must be a positive multiple of --per_node=8"),
    ({"waves": 1}, r"--waves=1, --tune_waves=40: at least 2 each"),
    ({"models": ("vgg",)}, r"--models: 'vgg' is not a full-size model"),
    ({"jobs": -1}, r"--jobs=-1: at least 0 \(0: one per core, 1: one simulation at a time\)"),
])
def test_a_bad_configuration_is_one_error(change, message):
  with pytest.raises(ConfigError, match=message):
    dataclasses.replace(ScaleConfig(), **change)


def test_a_gpt_runs_with_its_own_batch_precision_and_adam():
  setting = model_setting(ScaleConfig(gpt_batch_size=4, gpt_seq_len=128), "gpt2-xl")
  assert setting == (4, 128, "bf16", 2.0) and setting.items == 512
  assert model_setting(ScaleConfig(), "resnet152") == (32, None, "fp32", 1.0)
