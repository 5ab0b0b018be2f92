"""Model zoo: every model is a `LayeredModel` that can be cut at any unit boundary."""

from hetpipe_jax.models.base import InputSpec, LayeredModel, cross_entropy, num_params
from hetpipe_jax.models.cnn import small_cnn
from hetpipe_jax.models.custom import from_module, from_modules
from hetpipe_jax.models.gpt import gpt, gpt_num_params
from hetpipe_jax.models.inception import inception_v3
from hetpipe_jax.models.mlp import mlp
from hetpipe_jax.models.resnet import resnet
from hetpipe_jax.models.vgg import vgg
from hetpipe_jax.models.zoo import (
    FULL_SIZE,
    MODELS,
    FullSize,
    full_size_input,
    full_size_model,
    full_size_spec,
    get_model,
)

__all__ = [
    "FULL_SIZE", "MODELS", "FullSize", "InputSpec", "LayeredModel", "cross_entropy", "from_module", "from_modules",
    "full_size_input", "full_size_model", "full_size_spec", "get_model", "gpt", "gpt_num_params", "inception_v3",
    "mlp", "num_params", "resnet", "small_cnn", "vgg",
]
