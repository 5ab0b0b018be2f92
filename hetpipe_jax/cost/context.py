"""What a stage's cost and memory depend on beyond its units and its GPU: one value for the planner, the
memory model and the clock (:mod:`hetpipe_jax.cost.memory`)."""

from __future__ import annotations

from typing import NamedTuple

from hetpipe_jax.core.controls import PER_MINIBATCH, Control


class CostContext(NamedTuple):
  """Attributes:
    weight_mode: "stash" (Nm stashed weight versions per stage: one per minibatch in flight) or "latest" (none).
    optimizer_slots: parameter-sized fp32 arrays of optimizer state per parameter
      (:func:`hetpipe_jax.cost.memory.optimizer_slots_of`).
    precision: "fp32", or "fp16"/"bf16" (mixed precision, :mod:`hetpipe_jax.precision`).
    recompute: the activation recomputation the planner may give a stage (:mod:`hetpipe_jax.recompute`):
      "none", "selective" or "full" for every stage, or "auto" (per stage, the fastest that fits).
    state_shards: the data-parallel replicas that shard the gradient and the optimizer slots among them (ZeRO
      stage 2, :func:`hetpipe_jax.cost.memory.param_copies`); 1: each holds its own.
    shard_weights: with ``state_shards`` > 1, the replicas shard the weights too (ZeRO stage 3, FSDP), each
      gathering a unit's whole weights while it computes it (:func:`hetpipe_jax.cost.memory.stage_memory_bytes`).
    tp_by_type: a tensor-parallel degree per GPU type, for a planner that plans each stage by its group's lead
      (:mod:`hetpipe_jax.plan.tensor_groups`): a unit on a GPU of a type listed here is charged its profile split
      over that degree (:func:`degree_of`); empty: the profiles as given (split already, or not at all).
    activations: the activations a unit without recomputation is charged (:func:`hetpipe_jax.cost.memory.kept`):
      "jax", every residual of ``jax.vjp`` (what this package's runtime keeps), or "eager", what PyTorch or
      TensorFlow without XLA keep (:data:`hetpipe_jax.recompute.EAGER`), for the systems that run in them.
    control: the staleness control inside a virtual worker (:mod:`hetpipe_jax.core.controls`): how many weight
      versions ``stash`` keeps (2BW's groups: ceil(W / k) + 1, not W) and its own fp32 copies.
  """

  weight_mode: str = "stash"
  optimizer_slots: float = 0.0
  precision: str = "fp32"
  recompute: str = "none"
  state_shards: int = 1
  shard_weights: bool = False
  activations: str = "jax"
  tp_by_type: tuple[tuple[str, int], ...] = ()
  control: Control = PER_MINIBATCH


def degree_of(costs: CostContext, type_name: str) -> int:
  """The tensor-parallel degree ``costs.tp_by_type`` gives GPUs of type ``type_name`` (1: not listed)."""
  return dict(costs.tp_by_type).get(type_name, 1)


DEFAULT_COSTS = CostContext()  # fp32, stash, no optimizer state: the default of every function that takes one
