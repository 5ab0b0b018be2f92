"""Activation recomputation of a stage, by name: what its units keep for the backward pass and what they compute
again in it.

A unit is checkpointed on its own (``jax.checkpoint`` around each unit's apply, with a policy), so a stage keeps
the residuals its units' policy saves and, in the backward pass of one minibatch, recomputes one unit's
activations at a time:

* ``none``: every residual of ``jax.vjp`` is kept (no extra compute);
* ``selective``: the outputs of the weight matmuls (``dot_general`` with no batch dimensions) and of the
  convolutions are kept; everything else is recomputed: elementwise ops, normalisations, and attention's
  scores and probabilities (the batched ``dot_general`` of ``q k^T`` and ``probs v`` and the softmax). This is
  Megatron-LM's selective recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198): the attention core, whose memory grows with the square of the
  sequence, for a few percent of compute;
* ``full``: each unit keeps only its input and recomputes its whole forward in the backward pass (Chen et al.,
  "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, with one checkpoint per unit).

The numerics are those of ``none`` within rounding (XLA may fuse the recomputed ops differently). What each
mode costs (kept bytes, backward flops and bytes with the recomputation) is measured per unit by the profile
(:mod:`hetpipe_jax.cost.profile`) and charged by the memory and cost models through
:meth:`hetpipe_jax.cost.unit.UnitProfile.under`. ``auto`` lets the planner choose per stage: the cheapest
mode whose memory fits (:mod:`hetpipe_jax.plan.partition`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from hetpipe_jax.errors import ConfigError

MODES = ("none", "selective", "full")  # what a stage runs
CHOICES = MODES + ("auto",)  # what a user asks for: a mode for every stage, or the planner's choice per stage


def check_recompute(value: str, allowed: tuple[str, ...] = CHOICES) -> str:
  """Returns ``value`` if it names a recomputation in ``allowed``.

  Raises:
    ConfigError: naming the value and the allowed ones.
  """
  if value not in allowed:
    raise ConfigError(f"recompute={value!r}; use one of {', '.join(allowed)} (none: keep every activation; "
                      "selective: recompute attention and elementwise ops; full: recompute each unit; auto: the "
                      "planner's choice per stage)")
  return value


def allowed_modes(recompute: str) -> tuple[str, ...]:
  """The modes a stage may take when ``recompute`` is asked for: that one, or every one for ``auto``.

  Raises:
    ConfigError: for an unknown value.
  """
  return MODES if check_recompute(recompute) == "auto" else (recompute,)


def _selective(prim: Any, *_, **params: Any) -> bool:
  """Saves the weight matmuls' and the convolutions' outputs; everything else is recomputed."""
  if prim is lax.conv_general_dilated_p:
    return True
  if prim is lax.dot_general_p:
    (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    return not lhs_batch and not rhs_batch
  return False


def _eager(prim: Any, *_, **__: Any) -> bool:
  """Saves what an eager framework's autograd keeps (see :data:`EAGER`): the convolutions' and matmuls' outputs
  and the outputs of the functions with their own derivative rule (ReLU, softmax: ``custom_jvp`` calls)."""
  return prim in (lax.conv_general_dilated_p, lax.dot_general_p) or prim.name == "custom_jvp_call"


EAGER = _eager
"""The ``jax.checkpoint`` policy whose residuals are what PyTorch or TensorFlow without XLA keep for the backward
pass (the memory model's ``activations="eager"`` charge, :mod:`hetpipe_jax.cost.memory`): every convolution's and
matmul's output (the input of the normalisation or activation after it), the outputs of ReLU and softmax (an
in-place ReLU's output is the next convolution's input), and each unit's input; a normalisation's intermediates
are recomputed from its input, as cuDNN's fused batch-norm backward does from the input and two statistics.
Counted by hand on a matmul-ReLU-matmul and a
convolution-norm-ReLU unit (``tests/test_eager_memory.py``); ResNet-152 keeps 0.47 of the runtime's residuals under
it. For a GPT block it keeps about 0.8 of Korthikanti et al.'s count (arXiv 2205.05198, section 4.1, without
dropout): the LayerNorms' and the GELU's outputs, which PyTorch keeps as the next matmul's input, are recomputed
here. Used to count memory, never to run."""


def checkpointed(fn: Callable, mode: str) -> Callable:
  """``fn`` under recomputation ``mode`` (``none`` returns ``fn`` itself).

  Raises:
    ConfigError: for a mode not in :data:`MODES`.
  """
  if check_recompute(mode, MODES) == "none":
    return fn
  policy = _selective if mode == "selective" else jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint(fn, policy=policy)
