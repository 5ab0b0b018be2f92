"""Layouts a user gives by hand: virtual workers of ``stages`` GPUs each, taken in cluster order, cut at
``cuts`` or, without cuts, by the partitioner for the fastest stages in that GPU order."""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu, assign_gpus
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.plan.partition import partition


def per_vw(name: str, value: int | Sequence[int], n: int) -> list[int]:
  """``value`` for each of ``n`` virtual workers: one value for all, or a sequence of ``n``.

  Raises:
    ConfigError: when a sequence has another length.
  """
  values = [value] * n if isinstance(value, int) else list(value)
  if len(values) != n:
    raise ConfigError(f"{name} has {len(values)} values {values} for {n} virtual workers; give one "
                      "value, or one per virtual worker")
  return values


def fastest_cuts(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Sequence[Gpu]],
                 nms: Sequence[int], weight_mode: str, optimizer_slots: float) -> Layout:
  """Each virtual worker's GPUs kept in the given order, cut by the partitioner for the fastest stages.

  Raises:
    ConfigError: when no cut of a virtual worker fits its GPUs' memory.
  """
  return Layout(tuple(partition(cluster, profiles, g, nm, weight_mode, optimizer_slots, ordered=True).layout
                      for g, nm in zip(gpus, nms)))


def manual_layout(cluster: Cluster, profiles: Sequence[UnitProfile], num_vws: int,
                  stages: int | Sequence[int], nm: int | Sequence[int] | str, cuts: Sequence[Sequence[int]] | None,
                  weight_mode: str, optimizer_slots: float, model_name: str) -> Layout:
  """The layout of ``num_vws`` virtual workers with ``stages`` GPUs each (in cluster order), ``nm``, and
  ``cuts`` (one boundary list for all, or one per virtual worker; None: the fastest cuts).

  Raises:
    ConfigError: naming the bad value, its limit and the fix.
  """
  num_units = len(profiles)
  if num_vws < 1:
    raise ConfigError(f"num_vws={num_vws}; at least 1 virtual worker is needed")
  if isinstance(nm, str):
    raise ConfigError(f"nm={nm!r} picks Nm from a plan; give a number, or a policy (NP, ED, HD)")
  ks = per_vw("stages", stages, num_vws)
  nms = per_vw("nm", nm, num_vws)
  for i, n in enumerate(nms):
    if n < 1:
      raise ConfigError(f"Nm={n} for virtual worker {i}; Nm (minibatches in flight) must be >= 1")
  for i, k in enumerate(ks):
    if k > num_units:
      raise ConfigError(f"virtual worker {i} has {k} stages but model {model_name} has only {num_units} "
                        f"units to cut; use at most {num_units} stages")
  gpus = assign_gpus(cluster, ks)  # raises when the cluster is too small
  if cuts is None:
    return fastest_cuts(cluster, profiles, gpus, nms, weight_mode, optimizer_slots)
  cut_lists = [list(c) for c in cuts]
  if len(cut_lists) == 1 and num_vws > 1:
    cut_lists = cut_lists * num_vws  # one list for every virtual worker
  if len(cut_lists) != num_vws:
    raise ConfigError(f"cuts has {len(cut_lists)} entries for {num_vws} virtual workers; give one list for "
                      "all, or one per virtual worker")
  for i, (cut, k) in enumerate(zip(cut_lists, ks)):
    if (len(cut) != k + 1 or cut[0] != 0 or cut[-1] != num_units
        or any(a >= b for a, b in zip(cut, cut[1:]))):
      raise ConfigError(f"cuts {cut} of virtual worker {i} must be {k + 1} increasing boundaries from 0 "
                        f"to {num_units} (k={k} non-empty stages)")
  return Layout(tuple(VWLayout(tuple(g), tuple(c), n) for g, c, n in zip(gpus, cut_lists, nms)))
