"""Models cut at any unit boundary compose back to the whole model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpipe_jax import ConfigError
from hetpipe_jax.models import FULL_SIZE, full_size_input, full_size_model, get_model, num_params


@pytest.mark.parametrize("name", ["mlp", "cnn", "vgg", "resnet"])
@pytest.mark.parametrize("shape", [(4, 28, 28, 1), (4, 8, 8, 1)])
def test_every_cut_composes(name, shape):
  model = get_model(name)
  x = jax.random.normal(jax.random.key(1), shape)
  params = model.init(jax.random.key(0), x)
  assert len(params) == model.num_units == len(model.unit_names)
  full = model.apply(params, x)
  assert full.shape == (shape[0], 10)
  for cut in range(1, model.num_units):
    y = model.apply(params[:cut], x, 0, cut)
    np.testing.assert_allclose(model.apply(params[cut:], y, cut), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,units,params", [("vgg19", 19, 143.67e6), ("resnet152", 1 + 50 + 1, 60.19e6)])
def test_full_size_definitions_have_the_published_parameter_counts(name, units, params):
  model = full_size_model(name)
  x = full_size_input(name, 1)
  assert x.shape == (1, 224, 224, 3) and FULL_SIZE[name].num_classes == 1000
  assert model.num_units == units
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(x.shape, x.dtype))
  assert abs(num_params(shapes) - params) < 0.01e6
  assert jax.eval_shape(model.apply, shapes, x).shape == (1, 1000)


def test_full_size_names_are_checked():
  with pytest.raises(ConfigError, match="'cnn' is not a full-size model; use one of vgg19, resnet152"):
    full_size_model("cnn")
  with pytest.raises(ConfigError, match="unknown model 'vgg99'"):
    get_model("vgg99")
