"""Inception-v3 (Szegedy et al., 2016) for 299x299 inputs, as torchvision's ``inception_v3(aux_logits=False)``.

The units: the five stem convolutions (the two max pools ride with the convolution before them), each of the
eleven Inception blocks Mixed_5b .. Mixed_7c, and the classifier head (global average pooling and a linear
layer; dropout is left out, as from every model here). The auxiliary classifier is left out too: it only
shapes the training loss, and it would make Mixed_6e's unit feed two consumers.

Every convolution is torchvision's ``BasicConv2d``: no bias, a normalisation with epsilon 0.001 (torchvision's
and Keras' batch-norm epsilon) and a ReLU. As in :mod:`hetpipe_jax.models.resnet`, group normalisation
stands in for batch normalisation so that every unit is a pure function of its parameters (no batch
statistics to carry across pipeline stages); its scale and bias are batch norm's gamma and beta, so the
parameter count is torchvision's (whose running mean and variance are buffers, not parameters): 23,834,568.
"""

import math

import flax.linen as nn
import jax.numpy as jnp

from hetpipe_jax.models.base import LayeredModel

Size = tuple[int, int]


class BasicConv(nn.Module):
  """A convolution without bias, a normalisation (epsilon 0.001) and a ReLU (torchvision's ``BasicConv2d``).

  Attributes:
    features: output channels.
    kernel: the kernel's height and width.
    stride: the stride in both dimensions.
    padding: "SAME" (torchvision's padding of (k - 1) / 2, odd kernels) or "VALID" (no padding).
  """

  features: int
  kernel: Size = (1, 1)
  stride: int = 1
  padding: str = "SAME"

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.features, self.kernel, (self.stride, self.stride), padding=self.padding, use_bias=False)(x)
    # as many groups as divide the channels, up to 32 (48 or 80 channels: 16)
    return nn.relu(nn.GroupNorm(num_groups=math.gcd(32, self.features), epsilon=1e-3)(x))


def _avg_pool(x):
  """torchvision's ``avg_pool2d(x, 3, stride=1, padding=1)`` (the zero padding counted in the mean)."""
  return nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME", count_include_pad=True)


def _max_pool(x):
  """torchvision's ``max_pool2d(x, 3, stride=2)`` (no padding)."""
  return nn.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")


class StemConv(nn.Module):
  """A stem unit: one :class:`BasicConv`, then (with ``pool``) a 3x3 stride-2 max pool."""

  features: int
  kernel: Size = (3, 3)
  stride: int = 1
  padding: str = "VALID"
  pool: bool = False

  @nn.compact
  def __call__(self, x):
    x = BasicConv(self.features, self.kernel, self.stride, self.padding)(x)
    return _max_pool(x) if self.pool else x


class InceptionA(nn.Module):
  """Mixed_5b/5c/5d (35x35): 1x1; 1x1-5x5; 1x1-3x3-3x3; avg pool-1x1 (``pool_features`` wide)."""

  pool_features: int

  @nn.compact
  def __call__(self, x):
    b1 = BasicConv(64)(x)
    b5 = BasicConv(64, (5, 5))(BasicConv(48)(x))
    b3 = BasicConv(96, (3, 3))(BasicConv(96, (3, 3))(BasicConv(64)(x)))
    bp = BasicConv(self.pool_features)(_avg_pool(x))
    return jnp.concatenate([b1, b5, b3, bp], axis=-1)


class InceptionB(nn.Module):
  """Mixed_6a (35x35 to 17x17): 3x3 stride 2; 1x1-3x3-3x3 stride 2; max pool."""

  @nn.compact
  def __call__(self, x):
    b3 = BasicConv(384, (3, 3), 2, "VALID")(x)
    bd = BasicConv(96, (3, 3), 2, "VALID")(BasicConv(96, (3, 3))(BasicConv(64)(x)))
    return jnp.concatenate([b3, bd, _max_pool(x)], axis=-1)


class InceptionC(nn.Module):
  """Mixed_6b/6c/6d/6e (17x17): 1x1; 1x1-1x7-7x1; 1x1-7x1-1x7-7x1-1x7; avg pool-1x1 (``c7``: inner width)."""

  c7: int

  @nn.compact
  def __call__(self, x):
    c7 = self.c7
    b1 = BasicConv(192)(x)
    b7 = BasicConv(192, (7, 1))(BasicConv(c7, (1, 7))(BasicConv(c7)(x)))
    bd = BasicConv(c7)(x)
    for features, kernel in ((c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))):
      bd = BasicConv(features, kernel)(bd)
    bp = BasicConv(192)(_avg_pool(x))
    return jnp.concatenate([b1, b7, bd, bp], axis=-1)


class InceptionD(nn.Module):
  """Mixed_7a (17x17 to 8x8): 1x1-3x3 stride 2; 1x1-1x7-7x1-3x3 stride 2; max pool."""

  @nn.compact
  def __call__(self, x):
    b3 = BasicConv(320, (3, 3), 2, "VALID")(BasicConv(192)(x))
    b7 = BasicConv(192, (7, 1))(BasicConv(192, (1, 7))(BasicConv(192)(x)))
    b7 = BasicConv(192, (3, 3), 2, "VALID")(b7)
    return jnp.concatenate([b3, b7, _max_pool(x)], axis=-1)


class InceptionE(nn.Module):
  """Mixed_7b/7c (8x8): 1x1; 1x1-(1x3, 3x1); 1x1-3x3-(1x3, 3x1); avg pool-1x1."""

  @nn.compact
  def __call__(self, x):
    b1 = BasicConv(320)(x)
    b3 = BasicConv(384)(x)
    b3 = jnp.concatenate([BasicConv(384, (1, 3))(b3), BasicConv(384, (3, 1))(b3)], axis=-1)
    bd = BasicConv(384, (3, 3))(BasicConv(448)(x))
    bd = jnp.concatenate([BasicConv(384, (1, 3))(bd), BasicConv(384, (3, 1))(bd)], axis=-1)
    bp = BasicConv(192)(_avg_pool(x))
    return jnp.concatenate([b1, b3, bd, bp], axis=-1)


class Head(nn.Module):
  """Global average pooling and a linear classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


def inception_v3(num_classes: int = 1000) -> LayeredModel:
  """Inception-v3 without the auxiliary classifier, for 299x299x3 inputs (17 units).

  Args:
    num_classes: outputs of the head.

  Returns:
    The model, named ``inception_v3``; its units are named as torchvision's modules (a max pool's in the
    name of the convolution before it, ``_pool``), and ``head``.
  """
  units: list[nn.Module] = [
      StemConv(32, stride=2),  # 299 -> 149
      StemConv(32),  # -> 147
      StemConv(64, padding="SAME", pool=True),  # -> 147, pool -> 73
      StemConv(80, (1, 1)),
      StemConv(192, pool=True),  # -> 71, pool -> 35
      InceptionA(32), InceptionA(64), InceptionA(64),  # 35x35: 256, 288, 288 channels
      InceptionB(),  # 17x17x768
      InceptionC(128), InceptionC(160), InceptionC(160), InceptionC(192),
      InceptionD(),  # 8x8x1280
      InceptionE(), InceptionE(),  # 8x8x2048
      Head(num_classes),
  ]
  names = ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3_pool", "Conv2d_3b_1x1", "Conv2d_4a_3x3_pool",
           "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e",
           "Mixed_7a", "Mixed_7b", "Mixed_7c", "head")
  return LayeredModel("inception_v3", tuple(units), names)
