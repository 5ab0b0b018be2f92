"""The models by name: small ones that train on a CPU, and full-size ones for planning.

The full-size models (docs/PROTOCOL.md section 5: VGG-19 and ResNet-152 on ImageNet; beside them VGG-16,
ResNet-50, ResNet-101 and Inception-v3 (299x299 inputs), the other ImageNet models of the simulator's
fidelity checks; and GPT decoders too large for any one GPU: GPT-2 XL, 1.6B parameters with untied
embeddings, and GPT-3-shaped 6.7B and 13B) are profiled, planned and simulated, never trained here;
:data:`FULL_SIZE` holds their input shape (a GPT's: its context length of tokens), dtype and class count
(a GPT's: its vocabulary), the one place these numbers live. A GPT's sequence length can be shorter than
its context (:func:`full_size_spec`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.models.cnn import small_cnn
from hetpipe_jax.models.custom import load_factory
from hetpipe_jax.models.gpt import gpt
from hetpipe_jax.models.inception import inception_v3
from hetpipe_jax.models.mlp import mlp
from hetpipe_jax.models.resnet import resnet
from hetpipe_jax.models.vgg import vgg

MODELS = {
    "mlp": lambda num_classes: mlp(num_classes=num_classes),
    "cnn": lambda num_classes: small_cnn(num_classes=num_classes),
    "vgg": lambda num_classes: vgg("A", width=1 / 8, num_classes=num_classes, max_pools=3),
    "resnet": lambda num_classes: resnet(18, width=16, num_classes=num_classes),
    # A small GPT for the token datasets (num_classes = the vocabulary; sequences up to 64 tokens).
    "gpt": lambda num_classes: gpt(num_classes, layers=2, width=32, heads=2, context=64, name="gpt"),
    # The same GPT six blocks deep (8 units): the numerics of a study whose virtual workers have up to 8 GPUs.
    "gpt6": lambda num_classes: gpt(num_classes, layers=6, width=32, heads=2, context=64, name="gpt6"),
    # Twice as wide and twice as deep (14 units): does a study's ranking hold on a larger numerics proxy?
    "gpt12": lambda num_classes: gpt(num_classes, layers=12, width=64, heads=4, context=64, name="gpt12"),
    # Full size, for planning and profiling at 224x224 (every layer / residual block is a unit).
    "vgg19": lambda num_classes: vgg("E", width=1, classifier=4096, num_classes=num_classes),
    "resnet152": lambda num_classes: resnet(152, width=64, num_classes=num_classes, large_stem=True),
    "vgg16": lambda num_classes: vgg("D", width=1, classifier=4096, num_classes=num_classes),
    "resnet50": lambda num_classes: resnet(50, width=64, num_classes=num_classes, large_stem=True),
    "resnet101": lambda num_classes: resnet(101, width=64, num_classes=num_classes, large_stem=True),
    # At 299x299: five stem convolutions, the eleven Inception blocks and the head are the units.
    "inception_v3": lambda num_classes: inception_v3(num_classes=num_classes),
    # GPT-2 XL (Radford et al. 2019): 48 layers, d = 1600, 25 heads, context 1024.
    "gpt2-xl": lambda num_classes: gpt(num_classes, 48, 1600, 25, 1024, name="gpt2-xl"),
    # GPT-3 6.7B and 13B shapes (Brown et al. 2020, table 2.1): context 2048.
    "gpt-6.7b": lambda num_classes: gpt(num_classes, 32, 4096, 32, 2048, name="gpt-6.7b"),
    "gpt-13b": lambda num_classes: gpt(num_classes, 40, 5120, 40, 2048, name="gpt-13b"),
}


class FullSize(NamedTuple):
  """What a full-size model is trained on: one example's shape and dtype, and the number of classes
  (a GPT's: its vocabulary, the next token being the class)."""

  input_shape: tuple[int, ...]
  num_classes: int
  dtype: str = "float32"


IMAGENET = FullSize((224, 224, 3), 1000)
GPT2_VOCAB = 50257  # GPT-2's byte-pair vocabulary, which GPT-3 kept
FULL_SIZE = {"vgg19": IMAGENET, "resnet152": IMAGENET, "vgg16": IMAGENET, "resnet50": IMAGENET,
             "resnet101": IMAGENET, "inception_v3": FullSize((299, 299, 3), 1000),
             "gpt2-xl": FullSize((1024,), GPT2_VOCAB, "int32"),
             "gpt-6.7b": FullSize((2048,), GPT2_VOCAB, "int32"),
             "gpt-13b": FullSize((2048,), GPT2_VOCAB, "int32")}


def get_model(name: str, num_classes: int = 10) -> LayeredModel:
  """A model by name.

  Args:
    name: the small "mlp", "cnn", "vgg", "resnet", "gpt", "gpt6", "gpt12", or the full-size "vgg19", "resnet152",
      "vgg16", "resnet50", "resnet101", "inception_v3", "gpt2-xl", "gpt-6.7b", "gpt-13b" (for those,
      :func:`full_size_model` also picks the class count); or a user's ``package.module:factory``, a function
      that builds the model with no arguments (:func:`~hetpipe_jax.models.custom.load_factory`).
    num_classes: outputs of the last unit (of a built-in model).

  Returns:
    The model.

  Raises:
    ConfigError: for an unknown name, or a factory that cannot build the model.
  """
  if ":" in name:
    return load_factory(name)
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


def full_size_spec(name: str, seq_len: int | None = None) -> FullSize:
  """What a full-size model trains on, a GPT's sequence length set to ``seq_len``.

  Args:
    name: a key of :data:`FULL_SIZE`.
    seq_len: a GPT's tokens per example, 1 .. its context (None: its context); None for image models.

  Returns:
    The :class:`FullSize` (for a GPT with ``seq_len``: input shape ``(seq_len,)``).

  Raises:
    ConfigError: for a name that is not a full-size model, a sequence length outside 1 .. the context, or
      a sequence length for an image model.
  """
  spec = _full_size(name)
  if seq_len is None:
    return spec
  if spec.dtype != "int32":
    raise ConfigError(f"seq_len={seq_len} is for the GPT models; {name} takes {spec.input_shape} images: "
                      "drop seq_len")
  if not 1 <= seq_len <= spec.input_shape[0]:
    raise ConfigError(f"seq_len={seq_len}; {name} has a context of {spec.input_shape[0]} positions: use "
                      f"1 .. {spec.input_shape[0]}")
  return spec._replace(input_shape=(seq_len,))


def full_size_input(name: str, batch_size: int, seq_len: int | None = None) -> jax.ShapeDtypeStruct:
  """The shape of one minibatch of a full-size model (float32 images, or int32 tokens).

  Args:
    name: a key of :data:`FULL_SIZE`.
    batch_size: examples per minibatch.
    seq_len: a GPT's sequence length (see :func:`full_size_spec`).

  Returns:
    ``ShapeDtypeStruct((batch_size, *input_shape), dtype)``.

  Raises:
    ConfigError: for a name that is not a full-size model, or a bad ``seq_len``.
  """
  spec = full_size_spec(name, seq_len)
  return jax.ShapeDtypeStruct((batch_size,) + spec.input_shape, jnp.dtype(spec.dtype))
