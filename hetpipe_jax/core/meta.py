"""The trace's first line, ``meta``: one definition for every executor (docs/PROTOCOL.md, the trace).

The checker reads the protocol's fields (``num_vws``, ``nm``, ``d``, ``stages``, ``weight_mode``); the
rest say what ran. Fields with a default value that most runs keep (``window``, ``precision``, the
simulator's options) are written only when set, so older traces read the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hetpipe_jax.core.controls import PER_MINIBATCH, Control

VERSION = 1  # today's form: every task and pull with its N-entry ``glob``; 2: its ``seq`` instead
VERSIONS = (1, 2)


def meta_event(shape: Mapping[str, Any], d: int, weight_mode: str, schedule: str, executor: str, shards: int,
               version: int = VERSION, control: Control = PER_MINIBATCH, **extra: Any) -> dict[str, Any]:
  """The meta line of a run.

  Args:
    shape: the layout's fields (:meth:`hetpipe_jax.plan.layout.Layout.meta`: ``num_vws``, ``nm``,
      ``stages``, ``cuts``, ``gpus``, ``window`` when one is set, ``recompute`` when a stage recomputes, ``tp``
      when a stage is split by tensor parallelism).
    d / weight_mode / schedule: the protocol's knobs.
    executor: the executor's name.
    shards: parameter-server shards (one per unit).
    version: the trace format's version (:data:`VERSIONS`).
    control: the staleness control inside each virtual worker (written when not the default).
    **extra: what else the run records (model, dataset, options); a value of None is written as null.
  """
  head = {"ev": "meta", "version": version, "num_vws": shape["num_vws"], "nm": shape["nm"], "d": d,
          "stages": shape["stages"], "weight_mode": weight_mode, "executor": executor, "schedule": schedule,
          "shards": shards}
  tail = {k: shape[k] for k in ("cuts", "gpus", "window", "recompute", "tp") if k in shape}
  return {**head, **extra, **tail, **control_fields(control, shape["nm"])}


def control_fields(control: Control, nms: Sequence[int]) -> dict[str, Any]:
  """What the meta line records of a staleness control other than the default (:mod:`hetpipe_jax.core.controls`):
  its spec, and where it updates once per k minibatches each virtual worker's k (the checker reads it)."""
  if control == PER_MINIBATCH:
    return {}
  acc = [control.accumulate(nm) for nm in nms]
  return {"staleness": str(control), **({"accumulate": acc} if any(k != 1 for k in acc) else {})}


def meta_gpus(meta: Mapping[str, Any]) -> int:
  """Every GPU a run's meta line names: each stage's own and, where a stage is split by tensor parallelism, its
  partners (``tp``)."""
  return sum(meta["stages"]) + sum(len(partners) for vw in meta.get("tp") or [] for partners in vw)
