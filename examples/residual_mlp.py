"""Bring your own model: a residual MLP written in Flax (NNX blocks, linen stem and head), trained by HetPipe.

``model()`` is what ``--model=examples.residual_mlp:model`` builds in every process of a run (run from the
repository's root). Run this file to train it on two virtual workers and check the trace::

  python -m examples.residual_mlp
"""

import functools

import flax.linen as nn
from flax import nnx

import hetpipe_jax as hp


class Stem(nn.Module):  # linen: flatten the 8x8 image, project to the width
  width: int

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.width)(x.reshape(x.shape[0], -1))


class Residual(nnx.Module):  # NNX: pre-LayerNorm MLP block with a skip connection
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up, self.down = nnx.Linear(width, 2 * width, rngs=rngs), nnx.Linear(2 * width, width, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


def model(width: int = 32, blocks: int = 4, classes: int = 10) -> hp.LayeredModel:
  """Stem, ``blocks`` residual blocks and a linear head: ``blocks + 2`` units the planner can cut (each NNX block
  given as a function of rngs, so that the run's seed initialises it)."""
  units = [Stem(width), *(functools.partial(Residual, width) for _ in range(blocks)), nn.Dense(classes)]
  names = ["stem", *(f"block{i}" for i in range(blocks)), "head"]
  return hp.from_modules(units, names=names, input_shape=(8, 8, 1), name="residual_mlp")


def deep() -> hp.LayeredModel:
  """Ten residual blocks (12 units): room for the planner to move work between stages a few units at a time
  (``--model=examples.residual_mlp:deep``; what ``experiments.bench_live_adapt`` re-plans)."""
  return model(blocks=10)


if __name__ == "__main__":
  hp.ensure_cpu_devices(8)
  result = hp.run_hetpipe(model(), hp.synthetic(), hp.RunConfig.of(num_vws=2, stages=3, nm=2, d=1, waves=30))
  print("final:", result.metrics[-1])
  print("trace violations:", len(hp.check_trace(result.events)), "staleness:", hp.staleness_stats(result.events))
