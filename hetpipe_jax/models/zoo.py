"""The models by name: small ones that train on a CPU, and the paper's full-size ones for planning.

The full-size models (HETPIPE.md section 5: VGG-19 and ResNet-152 on ImageNet) are profiled and planned,
never trained here; :data:`FULL_SIZE` holds their input shape and class count, the one place these
numbers live.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.models.cnn import small_cnn
from hetpipe_jax.models.mlp import mlp
from hetpipe_jax.models.resnet import resnet
from hetpipe_jax.models.vgg import vgg

MODELS = {
    "mlp": lambda num_classes: mlp(num_classes=num_classes),
    "cnn": lambda num_classes: small_cnn(num_classes=num_classes),
    "vgg": lambda num_classes: vgg("A", width=1 / 8, num_classes=num_classes, max_pools=3),
    "resnet": lambda num_classes: resnet(18, width=16, num_classes=num_classes),
    # Full size, for planning and profiling at 224x224 (every layer / residual block is a unit).
    "vgg19": lambda num_classes: vgg("E", width=1, classifier=4096, num_classes=num_classes),
    "resnet152": lambda num_classes: resnet(152, width=64, num_classes=num_classes, large_stem=True),
}


class FullSize(NamedTuple):
  """What a full-size model is trained on: one example's shape and the number of classes."""

  input_shape: tuple[int, ...]
  num_classes: int


IMAGENET = FullSize((224, 224, 3), 1000)
FULL_SIZE = {"vgg19": IMAGENET, "resnet152": IMAGENET}


def get_model(name: str, num_classes: int = 10) -> LayeredModel:
  """A model by name.

  Args:
    name: the small "mlp", "cnn", "vgg", "resnet", or the full-size "vgg19", "resnet152" (for those,
      :func:`full_size_model` also picks the class count).
    num_classes: outputs of the last unit.

  Returns:
    The model.

  Raises:
    ConfigError: for an unknown name.
  """
  if name not in MODELS:
    raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
  return MODELS[name](num_classes)


def _full_size(name: str) -> FullSize:
  if name not in FULL_SIZE:
    raise ConfigError(f"{name!r} is not a full-size model; use one of {', '.join(FULL_SIZE)}")
  return FULL_SIZE[name]


def full_size_model(name: str) -> LayeredModel:
  """A full-size model with its own class count (``get_model(name, FULL_SIZE[name].num_classes)``).

  Args:
    name: a key of :data:`FULL_SIZE`.

  Returns:
    The model.

  Raises:
    ConfigError: for a name that is not a full-size model.
  """
  return get_model(name, _full_size(name).num_classes)


def full_size_input(name: str, batch_size: int) -> jax.ShapeDtypeStruct:
  """The shape of one float32 minibatch of a full-size model.

  Args:
    name: a key of :data:`FULL_SIZE`.
    batch_size: examples per minibatch.

  Returns:
    ``ShapeDtypeStruct((batch_size, *input_shape), float32)``.

  Raises:
    ConfigError: for a name that is not a full-size model.
  """
  return jax.ShapeDtypeStruct((batch_size,) + _full_size(name).input_shape, jnp.float32)
