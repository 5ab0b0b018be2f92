"""VGG-style networks (Simonyan and Zisserman, 2015): every convolution and every dense layer is a unit.

``vgg(cfg)`` takes the classic layer lists ('A', 'B', 'D', 'E' = VGG-11/13/16/19) with a width multiplier,
so the small variants train on 28x28 inputs and the full-size VGG-19 (width 1, 4096-wide classifier) is the
same code.
"""

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import ConvUnit, DenseUnit, LayeredModel

CONFIGS = {
    "A": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "B": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "D": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "E": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
          512, 512, 512, 512, "M"),
}


def vgg(cfg: str = "A", width: float = 1 / 8, classifier: int = 128, num_classes: int = 10,
        max_pools: int | None = None) -> LayeredModel:
  """A VGG net: one unit per convolution (its max pool included) and per classifier layer.

  Args:
    cfg: the layer list, "A", "B", "D" or "E" (VGG-11/13/16/19).
    width: multiplier of the channel counts.
    classifier: width of the two hidden classifier layers.
    num_classes: outputs of the last unit.
    max_pools: keep only the first this many pools (a 28x28 input survives 3 of the 5); None: all.

  Returns:
    The model, named ``vgg_<cfg>``.

  Raises:
    ConfigError: for an unknown ``cfg``.
  """
  if cfg not in CONFIGS:
    raise ConfigError(f"VGG configuration {cfg!r} is unknown; use one of {', '.join(CONFIGS)}")
  layers = CONFIGS[cfg]
  units, names, pools = [], [], 0
  for i, item in enumerate(layers):
    if item == "M":
      continue
    pool = i + 1 < len(layers) and layers[i + 1] == "M" and (max_pools is None or pools < max_pools)
    pools += pool
    units.append(ConvUnit(max(1, int(item * width)), pool=pool))
    names.append(f"conv{len(units)}" + ("_pool" if pool else ""))
  units += [DenseUnit(classifier), DenseUnit(classifier), DenseUnit(num_classes, relu=False)]
  names += ["fc1", "fc2", "logits"]
  return LayeredModel(f"vgg_{cfg}", tuple(units), tuple(names))
