"""The gradient noise scale of a model at given weights (McCandlish et al. 2018, "An empirical model of large-batch
training", arXiv 1812.06162): where a batch sits against the critical batch.

B_simple = tr(Sigma) / |G|^2, Sigma the per-example gradients' covariance and G their mean (the true gradient).
Both are estimated without bias from ``n`` per-example gradients g_i (their Appendix A.1 with B_small = 1 and
B_big = n)::

  |G|^2   ~ (n |mean g|^2 - mean |g_i|^2) / (n - 1)
  tr(S)   ~ (mean |g_i|^2 - |mean g|^2) / (1 - 1 / n)

A batch well below B_simple gains almost linearly from more examples per update; one well above it wastes them
(the number of updates to a target stops falling). An example is the study's: an image, or a sequence of a language
model (its loss the mean over its tokens).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hetpipe_jax.data import Dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models.base import LayeredModel


class NoiseScale(NamedTuple):
  """The estimate: B_simple, its two parts (|G|^2 and tr(Sigma)), the examples it is from, and where (in words)."""

  b_simple: float
  grad_norm_sq: float
  trace_cov: float
  examples: int
  at: str


def gradient_noise_scale(model: LayeredModel, params: Any, dataset: Dataset, examples: int = 1024, seed: int = 0,
                         chunk: int = 64, at: str = "") -> NoiseScale:
  """B_simple of ``model`` at ``params`` from ``examples`` training examples drawn by ``seed`` (``chunk`` per-example
  gradients at a time).

  Raises:
    ConfigError: for fewer than 2 examples, or more than the training set holds.
  """
  n = len(dataset.x_train)
  if not 2 <= examples <= n:
    raise ConfigError(f"examples={examples}; the noise scale needs 2..{n} training examples (the training set's)")
  pick = np.sort(np.random.default_rng(seed).choice(n, examples, replace=False))
  per_example = jax.vmap(jax.grad(lambda p, x, y: model.loss(model.apply(p, x[None]), y[None])), (None, 0, 0))

  @jax.jit
  def sums(p, x, y):
    grads = per_example(p, x, y)
    flat = jnp.concatenate([g.reshape(g.shape[0], -1) for g in jax.tree.leaves(grads)], axis=1)
    return flat.sum(0), jnp.sum(flat * flat)

  total, sq = None, 0.0
  for start in range(0, examples, chunk):
    idx = pick[start:start + chunk]
    g, s = sums(params, jnp.asarray(dataset.x_train[idx]), jnp.asarray(dataset.y_train[idx]))
    total = g if total is None else total + g
    sq += float(s)
  assert total is not None
  mean_sq = sq / examples                                # mean |g_i|^2
  big = float(jnp.sum((total / examples) ** 2))          # |mean g|^2
  grad_norm_sq = (examples * big - mean_sq) / (examples - 1)
  trace_cov = (mean_sq - big) / (1 - 1 / examples)
  b_simple = trace_cov / grad_norm_sq if grad_norm_sq > 0 else float("inf")
  return NoiseScale(b_simple, grad_norm_sq, trace_cov, examples, at)
