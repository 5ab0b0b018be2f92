"""ResNet-style networks (He et al., 2016): a stem unit, one unit per residual block, a head unit.

Group normalisation stands in for batch normalisation so that every unit is a pure function of its
parameters (no batch statistics to carry across pipeline stages); the parameter count is the same.
"""

import flax.linen as nn

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel


class Stem(nn.Module):
  """The first unit: a convolution and a normalisation (with ``large``, 7x7 stride 2 and a max pool)."""

  features: int
  large: bool = False  # 7x7 stride-2 conv + max pool, for 224x224 inputs

  @nn.compact
  def __call__(self, x):
    if self.large:
      x = nn.Conv(self.features, (7, 7), strides=(2, 2), use_bias=False)(x)
      x = nn.relu(nn.GroupNorm(num_groups=None, group_size=self.features // 32 or 1)(x))
      return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
    return nn.relu(nn.GroupNorm(num_groups=None, group_size=max(1, self.features // 8))(x))


def _norm(features):
  return nn.GroupNorm(num_groups=min(32, features // 2) or 1)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions and a shortcut (ResNet-18/34)."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x):
    s = (self.stride, self.stride)
    y = nn.relu(_norm(self.features)(nn.Conv(self.features, (3, 3), s, use_bias=False)(x)))
    y = _norm(self.features)(nn.Conv(self.features, (3, 3), use_bias=False)(y))
    if x.shape != y.shape:
      x = _norm(self.features)(nn.Conv(self.features, (1, 1), s, use_bias=False)(x))
    return nn.relu(x + y)


class Bottleneck(nn.Module):
  """1x1, 3x3, 1x1 convolutions (4x wider out) and a shortcut (ResNet-50/101/152)."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x):
    s = (self.stride, self.stride)
    y = nn.relu(_norm(self.features)(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    y = nn.relu(_norm(self.features)(nn.Conv(self.features, (3, 3), s, use_bias=False)(y)))
    y = _norm(4 * self.features)(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
    if x.shape != y.shape:
      x = _norm(4 * self.features)(nn.Conv(4 * self.features, (1, 1), s, use_bias=False)(x))
    return nn.relu(x + y)


class Head(nn.Module):
  """Global average pooling and a linear classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


DEPTHS = {18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False), 50: ((3, 4, 6, 3), True),
          101: ((3, 4, 23, 3), True), 152: ((3, 8, 36, 3), True)}


def resnet(depth: int = 18, width: int = 16, num_classes: int = 10, large_stem: bool = False,
           stages: int = 4) -> LayeredModel:
  """A ResNet: a stem unit, one unit per residual block, a head unit.

  Args:
    depth: 18, 34, 50, 101 or 152.
    width: channels of the first group (doubled per group).
    num_classes: outputs of the head.
    large_stem: the 224x224 stem (7x7 stride-2 convolution and a max pool).
    stages: keep only the first this many groups of blocks.

  Returns:
    The model, named ``resnet<depth>``.

  Raises:
    ConfigError: for an unknown depth.
  """
  if depth not in DEPTHS:
    raise ConfigError(f"ResNet depth {depth} is unknown; use one of {', '.join(map(str, DEPTHS))}")
  blocks, bottleneck = DEPTHS[depth]
  block = Bottleneck if bottleneck else BasicBlock
  units: list[nn.Module] = [Stem(width, large=large_stem)]
  names = ["stem"]
  for group, count in enumerate(blocks[:stages]):
    for b in range(count):
      stride = 2 if (b == 0 and group > 0) else 1
      units.append(block(width * 2**group, stride))
      names.append(f"layer{group + 1}.{b}")
  units.append(Head(num_classes))
  names.append("head")
  return LayeredModel(f"resnet{depth}", tuple(units), tuple(names))
