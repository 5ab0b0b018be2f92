"""GPT-style decoders (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019, GPT-2;
Brown et al., "Language Models are Few-Shot Learners", 2020, GPT-3 table 2.1 for the larger shapes) as
units the planner can cut: a token + position embedding, ``layers`` transformer blocks, and a final
LayerNorm + language-model head.

A block is pre-LayerNorm: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``, with causal multi-head
self-attention and a 4x-wide GELU MLP. The head's projection is *not* tied to the token embedding, so
every unit owns its parameters (one parameter-server shard each). Inputs are ``(batch, seq)`` int32
tokens, the output ``(batch, seq, vocab)`` logits; the loss is next-token cross-entropy
(:func:`hetpipe_jax.models.base.cross_entropy` with the next tokens as labels).

Parameters: embedding ``(V + C) d``, each block ``12 d^2 + 13 d``, head ``2 d + d V`` for vocabulary V,
context C and width d (:func:`gpt_num_params`). Attention is computed in full (no flash attention), so a
block keeps its ``heads x seq^2`` attention probabilities for the backward pass.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.tensor import COLUMNS, ROWS, SPLIT, WHOLE, TensorCosts, check_divides

_INIT = nn.initializers.normal(0.02)  # GPT-2's initialisation of every weight matrix


class Embedding(nn.Module):
  """Token embedding plus a learned position embedding of the first ``seq`` of ``context`` positions."""

  vocab_size: int
  width: int
  context: int

  @nn.compact
  def __call__(self, tokens):
    seq = tokens.shape[1]
    if seq > self.context:
      raise ConfigError(f"sequence length {seq} exceeds the model's context of {self.context} positions; "
                        f"use a sequence length <= {self.context}")
    x = nn.Embed(self.vocab_size, self.width, embedding_init=_INIT, name="tokens")(tokens)
    positions = self.param("positions", _INIT, (self.context, self.width))
    return x + positions[:seq]


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP, each residual."""

  width: int
  heads: int
  TP_COSTS = TensorCosts(fwd_allreduces=2, bwd_allreduces=2, whole_kept_inputs=2)  # Megatron-LM's f and g

  @nn.compact
  def __call__(self, x):
    batch, seq, width = x.shape
    head_dim = width // self.heads
    qkv = nn.Dense(3 * width, kernel_init=_INIT, name="qkv")(nn.LayerNorm(name="ln1")(x))
    q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * self.heads, head_dim), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / head_dim ** 0.5
    future = jnp.triu(jnp.full((seq, seq), jnp.finfo(scores.dtype).min, scores.dtype), 1)  # a constant
    probs = jax.nn.softmax(scores + future, axis=-1)  # masked by adding: nothing of the mask is kept
    attended = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, width)
    x = x + nn.Dense(width, kernel_init=_INIT, name="proj")(attended)
    h = nn.gelu(nn.Dense(4 * width, kernel_init=_INIT, name="fc")(nn.LayerNorm(name="ln2")(x)))
    return x + nn.Dense(width, kernel_init=_INIT, name="out")(h)

  def tensor_parallel(self, params, degree: int):
    """Megatron-LM's split over ``degree`` devices (:mod:`hetpipe_jax.tensor`): attention heads and the MLP's
    hidden features; the LayerNorms and the biases added after a row-split kernel whole."""
    check_divides(degree, {"heads": self.heads, "MLP width": 4 * self.width}, "GPT block")
    def spec(name: str, key: str):
      if name in ("qkv", "fc"):  # split by output features: the kernel by columns, its bias alike
        return COLUMNS if key == "kernel" else SPLIT
      return ROWS if name in ("proj", "out") and key == "kernel" else WHOLE  # a row split's bias: after the sum
    return {name: {key: spec(name, key) for key in leaves} for name, leaves in params.items()}


class Head(nn.Module):
  """Final LayerNorm and the (untied) projection to the vocabulary's logits."""

  vocab_size: int
  TP_COSTS = TensorCosts(fwd_allreduces=0, bwd_allreduces=1, whole_kept_inputs=1)  # the input gradient's sum

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.vocab_size, use_bias=False, kernel_init=_INIT, name="logits")(nn.LayerNorm(name="ln")(x))

  def tensor_parallel(self, params, degree: int):
    """The vocabulary split over ``degree`` devices (Megatron-LM's parallel output layer); the LayerNorm whole."""
    check_divides(degree, {"vocabulary": self.vocab_size}, "GPT head")
    return {"ln": {key: WHOLE for key in params["ln"]}, "logits": {"kernel": COLUMNS}}


def gpt(vocab_size: int, layers: int, width: int, heads: int, context: int, name: str = "gpt") -> LayeredModel:
  """A GPT decoder as ``layers + 2`` units: ``embed``, ``block1`` .. ``blockN``, ``head``.

  Args:
    vocab_size: tokens in the vocabulary (the head's outputs).
    layers: transformer blocks.
    width: the model width d (divisible by ``heads``).
    heads: attention heads per block.
    context: positions of the position embedding (the longest sequence).
    name: the model's name.

  Returns:
    The model.

  Raises:
    ConfigError: for a width not divisible by the heads, or a non-positive size.
  """
  if min(vocab_size, layers, width, heads, context) < 1:
    raise ConfigError(f"GPT sizes vocab={vocab_size}, layers={layers}, width={width}, heads={heads}, "
                      f"context={context}; every one must be >= 1")
  if width % heads:
    raise ConfigError(f"GPT width {width} is not divisible by {heads} heads; use a width that is a multiple "
                      "of the head count")
  units = (Embedding(vocab_size, width, context),) + tuple(Block(width, heads) for _ in range(layers)) + (
      Head(vocab_size),)
  names = ("embed",) + tuple(f"block{i + 1}" for i in range(layers)) + ("head",)
  return LayeredModel(name, units, names)


def gpt_num_params(vocab_size: int, layers: int, width: int, context: int) -> int:
  """The parameter count of :func:`gpt` by formula: ``(V + C) d + L (12 d^2 + 13 d) + 2 d + d V``."""
  d = width
  return (vocab_size + context) * d + layers * (12 * d * d + 13 * d) + 2 * d + d * vocab_size
