"""A small CNN for 28x28 (or 8x8) grey images: conv units, then dense units."""

from hetpipe_jax.models.base import ConvUnit, DenseUnit, LayeredModel


def small_cnn(num_classes: int = 10, width: int = 32) -> LayeredModel:
  units = (
      ConvUnit(width),
      ConvUnit(width, pool=True),
      ConvUnit(2 * width, pool=True),
      DenseUnit(128),
      DenseUnit(num_classes, relu=False),
  )
  names = ("conv1", "conv2_pool", "conv3_pool", "fc", "logits")
  return LayeredModel("cnn", units, names)
