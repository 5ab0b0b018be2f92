"""Profiler sanity: XLA flop counts, exact parameter bytes, caching, calibration, the roofline."""

import dataclasses
import os
import subprocess
import sys
import uuid

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from hetpipe_jax.cluster import CATALOGUE
from hetpipe_jax.cost.profile import default_cache_dir, full_size_profiles, profile_units
from hetpipe_jax.cost.roofline import calibrate_efficiency, unit_seconds
from hetpipe_jax.models import get_model
from hetpipe_jax.models.base import DenseUnit, LayeredModel

HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hetpipe_jax", "profiles")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dense_flops_and_bytes():
  b, n_in, n_out = 32, 256, 128
  model = LayeredModel("dense", (DenseUnit(n_out, relu=False),), ("d",))
  (prof,) = profile_units(model, jax.ShapeDtypeStruct((b, n_in), jnp.float32), cache_dir=None)
  assert prof.fwd_flops == pytest.approx(2 * b * n_in * n_out, rel=0.01)
  assert prof.bwd_flops == pytest.approx(2 * 2 * b * n_in * n_out, rel=0.01)  # grad input + grad kernel
  assert prof.param_bytes == 4 * (n_in * n_out + n_out)
  assert prof.out_bytes == 4 * b * n_out


def test_full_size_models_profile_quickly_with_published_sizes():
  for name, params_m, gflop in (("vgg19", 143.67, 39.0), ("resnet152", 60.19, 22.6)):
    profiles = full_size_profiles(name, 32, cache_dir=None)
    assert sum(u.param_bytes for u in profiles) / 4 / 1e6 == pytest.approx(params_m, abs=0.01)
    # Forward flops per image (2 per multiply-add): VGG-19 ~19.6 GMACs, ResNet-152 ~11.3 GMACs.
    assert sum(u.fwd_flops for u in profiles) / 32 / 1e9 == pytest.approx(gflop, rel=0.05)
    assert all(u.kept_bytes > 0 and u.bwd_flops >= u.fwd_flops for u in profiles)


def test_profiles_are_cached_on_disk(tmp_path):
  model = get_model("cnn")
  x = jax.ShapeDtypeStruct((16, 28, 28, 1), jnp.float32)
  first = profile_units(model, x, cache_dir=str(tmp_path))
  assert len(list(tmp_path.iterdir())) == 1
  assert profile_units(model, x, cache_dir=str(tmp_path)) == first
  profile_units(model, jax.ShapeDtypeStruct((32, 28, 28, 1), jnp.float32), cache_dir=str(tmp_path))
  assert len(list(tmp_path.iterdir())) == 2  # another batch size, another entry


def _probe_model() -> LayeredModel:
  """A tiny model under a name no earlier run used, so its cache entry can be looked for anywhere."""
  return LayeredModel(f"cache-probe-{uuid.uuid4().hex[:12]}", (DenseUnit(4),), ("d",))


def _entries(directory: str, model: LayeredModel) -> list[str]:
  if not os.path.isdir(directory):
    return []
  return [f for f in os.listdir(directory) if f.startswith(model.name + "-")]


def test_tests_profile_into_the_sessions_cache_not_the_home_cache():
  session = os.environ["HETPIPE_JAX_CACHE"]  # set by conftest.py
  assert os.path.realpath(session) != os.path.realpath(HOME_CACHE)
  model = _probe_model()
  profile_units(model, jax.ShapeDtypeStruct((2, 3), jnp.float32))  # the default cache
  assert len(_entries(session, model)) == 1
  assert _entries(HOME_CACHE, model) == []


def test_cache_directory_comes_from_the_environment_at_call_time(monkeypatch, tmp_path):
  session, elsewhere = os.environ["HETPIPE_JAX_CACHE"], tmp_path / "elsewhere"
  monkeypatch.setenv("HETPIPE_JAX_CACHE", str(elsewhere))  # after the package was imported
  model = _probe_model()
  profile_units(model, jax.ShapeDtypeStruct((2, 3), jnp.float32))
  assert len(_entries(str(elsewhere), model)) == 1
  assert _entries(session, model) == []
  monkeypatch.delenv("HETPIPE_JAX_CACHE")
  assert default_cache_dir() == HOME_CACHE  # unset: the home cache, as before


def test_subprocesses_inherit_the_sessions_cache():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # as CLI tests do
  name = _probe_model().name
  code = ("import jax, jax.numpy as jnp\n"
          "from hetpipe_jax.models.base import DenseUnit, LayeredModel\n"
          "from hetpipe_jax.cost.profile import default_cache_dir, profile_units\n"
          f"profile_units(LayeredModel({name!r}, (DenseUnit(4),), ('d',)), "
          "jax.ShapeDtypeStruct((2, 3), jnp.float32))\n"
          "print(default_cache_dir())\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines()[-1] == os.environ["HETPIPE_JAX_CACHE"]
  model = LayeredModel(name, (DenseUnit(4),), ("d",))
  assert len(_entries(os.environ["HETPIPE_JAX_CACHE"], model)) == 1
  assert _entries(HOME_CACHE, model) == []


def test_roofline_and_calibration():
  profiles = profile_units(get_model("cnn"), jax.ShapeDtypeStruct((32, 28, 28, 1), jnp.float32),
                           cache_dir=None)
  gpu = CATALOGUE["TITAN V"]
  u = profiles[1]
  fwd, _ = unit_seconds(u, gpu)
  assert fwd == pytest.approx(max(u.fwd_flops / gpu.fp32_flops, u.fwd_bytes / gpu.mem_bytes_per_s)
                              / gpu.efficiency)
  ideal = dataclasses.replace(gpu, efficiency=1.0)
  measured = {i: sum(unit_seconds(profiles[i], ideal)) / 0.3 for i in range(3)}  # a GPU at 30% of its roofline
  assert calibrate_efficiency(gpu, profiles, measured).efficiency == pytest.approx(0.3)
  assert unit_seconds(u, gpu, "fp16")[0] <= fwd
  # a unit of a family takes that family's factor of the type (the catalogue's VGG figure), others the default
  vgg = dataclasses.replace(u, family="vgg")
  assert gpu.efficiency_for("vgg") != gpu.efficiency
  assert unit_seconds(vgg, gpu)[0] == pytest.approx(fwd * gpu.efficiency / gpu.efficiency_for("vgg"))
  assert [p.family for p in profile_units(get_model("vgg"), jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32),
                                          cache_dir=None)][:1] == ["vgg"]


class Twice(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(x.shape[-1])(x)


def test_repeated_units_are_profiled_once_but_named_apart():
  model = LayeredModel("rep", (Twice(), Twice(), Twice()), ("a", "b", "c"))
  profiles = profile_units(model, jax.ShapeDtypeStruct((4, 8), jnp.float32), cache_dir=None)
  assert [p.name for p in profiles] == ["a", "b", "c"]
  assert profiles[0].fwd_flops == profiles[2].fwd_flops > 0
