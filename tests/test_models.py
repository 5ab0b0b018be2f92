"""Models cut at any unit boundary compose back to the whole model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpipe_jax.models import get_model, num_params, resnet, vgg


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


def test_full_size_definitions_have_the_published_parameter_counts():
  count = lambda m, hw: num_params(jax.eval_shape(m.init, jax.random.key(0), jnp.zeros((1, hw, hw, 3))))
  vgg19 = vgg("E", width=1, classifier=4096, num_classes=1000)
  assert vgg19.num_units == 19
  assert abs(count(vgg19, 224) - 143.67e6) < 0.01e6
  resnet152 = resnet(152, width=64, num_classes=1000, large_stem=True)
  assert resnet152.num_units == 1 + 50 + 1
  assert abs(count(resnet152, 224) - 60.19e6) < 0.01e6
