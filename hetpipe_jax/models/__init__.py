"""Model zoo: every model is a `LayeredModel` that can be cut at any unit boundary."""

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel, cross_entropy, num_params
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
FULL_SIZE_INPUT = {"vgg19": (224, 224, 3), "resnet152": (224, 224, 3)}  # ImageNet-shaped inputs


def get_model(name: str, num_classes: int = 10) -> LayeredModel:
  """Returns a model by name for ``num_classes`` outputs: the small "mlp", "cnn", "vgg", "resnet", or the
  full-size "vgg19" and "resnet152" (inputs of ``FULL_SIZE_INPUT``).

  Raises:
    ConfigError: for an unknown name.
  """
  if name not in MODELS:
    raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
  return MODELS[name](num_classes)


__all__ = ["FULL_SIZE_INPUT", "LayeredModel", "cross_entropy", "get_model", "mlp", "num_params", "resnet", "small_cnn",
           "vgg", "MODELS"]
