"""A small CNN for 28x28 (or 8x8) grey images: conv units, then dense units."""

from hetpipe_jax.models.base import ConvUnit, DenseUnit, LayeredModel


def small_cnn(num_classes: int = 10, width: int = 32) -> LayeredModel:
  """Three 3x3 convolution units (two with a 2x2 max pool), a Dense unit and a linear output unit.

  Args:
    num_classes: outputs of the last unit.
    width: channels of the first convolutions (the third has twice as many).

  Returns:
    The model, five units.
  """
  units = (
      ConvUnit(width),
      ConvUnit(width, pool=True),
      ConvUnit(2 * width, pool=True),
      DenseUnit(128),
      DenseUnit(num_classes, relu=False),
  )
  names = ("conv1", "conv2_pool", "conv3_pool", "fc", "logits")
  return LayeredModel("cnn", units, names)
