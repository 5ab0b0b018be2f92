"""Bad input, fuzzed (issue 10): random configurations and random cluster files either run and pass the
WSP checker or stop with one ConfigError line (what the CLIs print as ``error: ...``, exit 1): never
another exception, never a hang."""

import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hetpipe_jax import ConfigError, RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.cluster.toml import load_cluster_toml

from helpers import assert_trace_ok

MODEL, DATA = get_model("mlp"), synthetic(num_train=256, num_test=64)
FUZZ = settings(max_examples=int(os.environ.get("HETPIPE_FUZZ_EXAMPLES", "20")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def runs_or_config_error(config: RunConfig):
  """The run's result (its trace checked), or None after a one-line ConfigError."""
  try:
    result = run_hetpipe(MODEL, DATA, config)
  except ConfigError as e:
    assert str(e) and "\n" not in str(e), repr(str(e))
    return None
  assert_trace_ok(result.events)
  return result


@st.composite
def configurations(draw) -> tuple[RunConfig, str | None]:
  """A valid configuration, or one with a single bad field (then also its name)."""
  num_vws, stages = draw(st.integers(1, 3)), draw(st.integers(1, 2))
  policy = draw(st.sampled_from([None, None, "NP", "ED", "HD"]))
  cuts = None
  if policy is None and draw(st.booleans()):  # explicit cuts: `stages` non-empty ranges of the 4 units
    inner = sorted(draw(st.sets(st.integers(1, MODEL.num_units - 1), min_size=stages - 1, max_size=stages - 1)))
    cuts = [[0, *inner, MODEL.num_units]]
  waves = draw(st.integers(1, 3))
  fields = dict(
      cluster=draw(st.sampled_from(["hetero4", "uniform8"])), num_vws=num_vws, stages=stages,
      nm=draw(st.integers(1, 3)), d=draw(st.integers(0, 2)), waves=waves, batch_size=draw(st.sampled_from([16, 32])),
      optimizer=draw(st.sampled_from(["sgd", "momentum", "adam"])), learning_rate=draw(st.sampled_from([0.01, 0.1])),
      executor=draw(st.sampled_from(["virtual", "sim", "wall"])), policy=policy,
      placement=draw(st.sampled_from(["default", "local"])), cuts=cuts,
      weight_mode=draw(st.sampled_from(["stash", "latest"])), schedule=draw(st.sampled_from(["1f1b", "fifo", "gpipe"])),
      eval_every=waves)
  bad = draw(st.one_of(st.none(), st.sampled_from(list(BAD))))
  if bad is not None:
    fields[bad] = draw(st.sampled_from(BAD[bad]))
    if bad in ("num_vws", "stages", "cuts"):
      fields["policy"] = None
  return RunConfig.of(**fields), bad


BAD = {"num_vws": [0, -1, 5], "stages": [0, 9], "nm": [0, -2], "d": [-1], "waves": [0, -3],
       "batch_size": [0, 7, 300, -16], "optimizer": ["rmsprop", ""], "learning_rate": [0.0, -1.0, math.nan, math.inf],
       "executor": ["gpu", ""], "placement": ["far"], "weight_mode": ["newest"], "schedule": ["lifo"],
       "cluster": ["nowhere", "missing.toml"], "cuts": [[[0, 9]], [[2, 1, 4]], [[0, 4], [0, 2, 4], [0, 1]], [[]]],
       "policy": [[[0, 0], [1]], [[9, 1]], "XY", []], "seed": [-5, 2**63], "time_scale": [-1.0, math.nan]}


@pytest.mark.slow
@FUZZ
@given(case=configurations())
def test_random_configurations_run_or_fail_in_one_line(case):
  config, bad = case
  result = runs_or_config_error(config)
  event("ran" if result is not None else "refused")
  if bad is None:  # a valid configuration runs
    assert result is not None
  elif bad not in ("cuts", "policy", "num_vws", "stages"):  # these may happen to work with some layouts
    assert result is None, f"{bad}={getattr(config, bad)!r} ran"


def _toml_value(value) -> str:
  if isinstance(value, str):
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, list):
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
  return repr(value) if not isinstance(value, float) or math.isfinite(value) else ("nan" if value != value else
                                                                                  ("inf" if value > 0 else "-inf"))


GOOD_GPU = {"memory_gib": 8, "fp32_tflops": 4.5, "bandwidth_gbytes_per_s": 300, "efficiency": 0.5}
BAD_NUMBERS = [0, -2, math.nan, math.inf, "12", True, None]


@st.composite
def cluster_files(draw) -> tuple[str, bool]:
  """A cluster file's text, and whether it is valid (else one part is broken)."""
  names = ["TITAN V", "V100", "T4", "MyGPU"]
  nodes = draw(st.lists(st.lists(st.sampled_from(names), min_size=1, max_size=3), min_size=1, max_size=3))
  gpu, links = dict(GOOD_GPU), {"intra_node": "pcie3", "inter_node": {"gbytes_per_s": 12.5, "latency_us": 5}}
  bad = draw(st.one_of(st.none(), st.sampled_from(["gpu", "link", "name", "nodes", "syntax", "tables"])))
  if bad == "gpu":
    gpu[draw(st.sampled_from(sorted(GOOD_GPU)))] = draw(st.sampled_from(BAD_NUMBERS))
  elif bad == "link":
    links[draw(st.sampled_from(sorted(links)))] = draw(st.sampled_from(
        ["carrier pigeon", 5, {"gbytes_per_s": -1}, {"gbytes_per_s": math.nan}, {"latency_us": 3}]))
  elif bad == "name":
    nodes[0] = [*nodes[0], draw(st.sampled_from(["Nope", "", "titan v"]))]
  elif bad == "nodes":
    nodes = draw(st.sampled_from([[], [[]], [[], ["T4"]]]))
  lines = ['name = "fuzz"']
  if bad == "tables":
    lines += [draw(st.sampled_from(['links = "fast"', 'gpu_types = 3', 'gpu_types = {MyGPU = "big"}']))]
  else:
    lines += [f"links = {_toml_value(links)}", f"gpu_types = {{MyGPU = {_toml_value(gpu)}}}"]
  lines += [f"nodes = {_toml_value([{'gpus': gpus} for gpus in nodes])}" if nodes else ""]
  text = "\n".join(lines) + ("\n[[nodes" if bad == "syntax" else "\n")
  return text, bad is None


@FUZZ
@given(case=cluster_files())
def test_random_cluster_files_load_or_fail_in_one_line(case):
  text, valid = case
  with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
    f.write(text)
  try:
    try:
      cluster = load_cluster_toml(f.name)
    except ConfigError as e:
      assert str(e) and "\n" not in str(e), repr(str(e))
      assert not valid, f"a valid file was refused: {e}"
      event("cluster file refused")
      return
    assert valid, f"a broken file loaded:\n{text}"
    event("cluster file loaded")
    result = runs_or_config_error(RunConfig.of(cluster=cluster, num_vws=1, stages=min(2, cluster.num_gpus),
                                            nm=1, waves=2, executor="sim"))
    assert result is not None and result.images_per_second > 0
  finally:
    os.unlink(f.name)


@pytest.mark.parametrize("text,message", [
    ("", "no [[nodes]]"),
    ("[[nodes]]\ngpus = []\n", "nodes[0].gpus must be a non-empty list"),
    ('gpu_types = 3\n[[nodes]]\ngpus = ["V100"]\n', "gpu_types must be a table"),
    ('links = "fast"\n[[nodes]]\ngpus = ["V100"]\n', "links must be a table"),
])
def test_known_bad_cluster_files(tmp_path, text, message):
  path = tmp_path / "c.toml"
  path.write_text(text)
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    load_cluster_toml(str(path))
