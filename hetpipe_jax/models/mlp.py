"""Multi-layer perceptron: one unit per Dense layer."""

from hetpipe_jax.models.base import DenseUnit, LayeredModel


def mlp(hidden: tuple[int, ...] = (128, 128, 64), num_classes: int = 10) -> LayeredModel:
  """A multi-layer perceptron (inputs are flattened).

  Args:
    hidden: widths of the hidden Dense + ReLU units.
    num_classes: outputs of the last (linear) unit.

  Returns:
    The model, one unit per Dense layer.
  """
  units = tuple(DenseUnit(h) for h in hidden) + (DenseUnit(num_classes, relu=False),)
  names = tuple(f"dense{i}" for i in range(len(hidden))) + ("logits",)
  return LayeredModel("mlp", units, names)
