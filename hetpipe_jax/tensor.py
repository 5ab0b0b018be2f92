"""Tensor parallelism inside a pipeline stage, as Megatron-LM splits a transformer (Shoeybi et al., "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism", arXiv 1909.08053, section 3).

A stage of degree t runs on t devices of one node, a mesh with one axis (:data:`AXIS`). A unit with a rule (a
method ``tensor_parallel(params, degree)`` returning a ``PartitionSpec`` per parameter) keeps each weight split
across the t devices: a GPT block splits its attention heads (the ``qkv`` projection by columns, ``proj`` by
rows) and its MLP (``fc`` by columns, ``out`` by rows), so a forward needs one all-reduce after attention and one
after the MLP, and a backward two more. A unit without a rule keeps its weights whole on every device, and every
device computes it entirely (Megatron-LM does so with the LayerNorms). A stage's input and output are whole
on every device. The arrays are ``jax.sharding.NamedSharding``-placed and XLA's SPMD partitioner inserts the
collectives, so the numerics are those of one device within rounding (the all-reduce adds partial products in
another order).

``--tp=N`` asks for N devices per stage (a layout of ``--num_vws`` and ``--stages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpipe_jax.errors import ConfigError

AXIS = "tp"  # the mesh axis of a stage's devices
COLUMNS = PartitionSpec(None, AXIS)  # a (in, out) kernel split by output features
ROWS = PartitionSpec(AXIS, None)  # a (in, out) kernel split by input features
SPLIT = PartitionSpec(AXIS)  # a vector split (the bias of a column-split kernel)
WHOLE = PartitionSpec()  # on every device


class TensorCosts(NamedTuple):
  """What a unit's rule costs beyond its split compute, declared next to the rule (a unit's ``TP_COSTS``).

  Attributes:
    fwd_allreduces / bwd_allreduces: all-reduces of the unit's input-sized activation per forward / backward
      pass (a GPT block: 2 and 2, Megatron-LM's f and g operators).
    whole_kept_inputs: activations kept whole on every device for the backward pass, in multiples of the unit's
      input (a GPT block: its two LayerNorms' inputs).
  """

  fwd_allreduces: int
  bwd_allreduces: int
  whole_kept_inputs: float


def has_rule(unit: Any) -> bool:
  """Whether ``unit`` splits its weights across a stage's devices (it has a ``tensor_parallel`` method)."""
  return callable(getattr(unit, "tensor_parallel", None))


def unit_costs(unit: Any) -> TensorCosts | None:
  """The ``TP_COSTS`` of a unit with a rule (None without one).

  Raises:
    ConfigError: for a unit with a rule that does not declare them.
  """
  if not has_rule(unit):
    return None
  costs = getattr(unit, "TP_COSTS", None)
  if not isinstance(costs, TensorCosts):
    raise ConfigError(f"unit {type(unit).__name__} has a tensor_parallel rule but no TP_COSTS (a TensorCosts: its "
                      "all-reduces and whole activations); declare them next to the rule")
  return costs


def split_param_bytes(unit: Any, params: Any) -> int:
  """The bytes of ``unit``'s parameters its rule splits (0 without a rule); ``params`` may be shapes."""
  if not has_rule(unit):
    return 0
  specs = jax.tree.leaves(unit.tensor_parallel(params, 1), is_leaf=lambda x: isinstance(x, PartitionSpec))
  sizes = [int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in jax.tree.leaves(params)]
  return sum(size for size, spec in zip(sizes, specs) if spec != WHOLE)


def check_divides(degree: int, sizes: dict[str, int], unit: str) -> None:
  """Raises a ConfigError unless ``degree`` divides every one of ``sizes`` (name -> size) of ``unit``."""
  bad = {name: size for name, size in sizes.items() if size % degree}
  if bad:
    raise ConfigError(f"tensor-parallel degree {degree} does not divide {unit}'s "
                      f"{', '.join(f'{n} ({s})' for n, s in bad.items())}; use a degree that divides them")


def unit_specs(unit: Any, params: Any, degree: int) -> Any:
  """The ``PartitionSpec`` of each parameter of ``unit`` at ``degree`` (every one whole without a rule)."""
  if degree == 1 or not has_rule(unit):
    return jax.tree.map(lambda _: WHOLE, params)
  return unit.tensor_parallel(params, degree)


def stage_mesh(devices: Sequence[Any]) -> Mesh:
  """A one-axis mesh of a stage's devices, in the order given."""
  return Mesh(np.array(list(devices), dtype=object), (AXIS,))


def param_shardings(units: Sequence[Any], params: Sequence[Any], mesh: Mesh) -> tuple[Any, ...]:
  """One pytree of ``NamedSharding`` per unit: where each parameter of a stage's units lives on ``mesh``.

  Raises:
    ConfigError: when the mesh's size does not divide a split dimension of a unit.
  """
  degree = mesh.devices.size
  return tuple(jax.tree.map(lambda spec: NamedSharding(mesh, spec), unit_specs(unit, p, degree),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
               for unit, p in zip(units, params))


def onto_mesh(tree: Any, whole: NamedSharding) -> Any:
  """``tree`` with every array not already on ``whole``'s mesh put there whole (an optimizer's step count,
  created on the default device, for instance); other leaves unchanged."""
  def place(x):
    sharding = getattr(x, "sharding", None)
    on_mesh = isinstance(sharding, NamedSharding) and sharding.mesh == whole.mesh
    return x if on_mesh or not isinstance(x, (jax.Array, np.ndarray)) else jax.device_put(x, whole)
  return jax.tree.map(place, tree)
