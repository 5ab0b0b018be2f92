"""Layouts a user gives by hand: virtual workers of ``stages`` GPUs each, taken in cluster order, cut at
``cuts`` or, without cuts, by the partitioner for the fastest stages in that GPU order; or, with
:func:`grouped_layout`, every virtual worker's GPUs, order, cuts and Nm given (a tuned plan)."""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu, assign_gpus
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.layout import Layout, VWLayout, per_vw
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.plan.vw_plan import vw_plan


def fastest_cuts(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Sequence[Gpu]],
                 nms: Sequence[int], costs: CostContext = DEFAULT_COSTS) -> Layout:
  """Each virtual worker's GPUs kept in the given order, cut by the partitioner for the fastest stages
  (at ``precision``: its stage times and memory).

  Raises:
    ConfigError: when no cut of a virtual worker fits its GPUs' memory.
  """
  return Layout(tuple(partition(cluster, profiles, g, nm, costs, ordered=True).layout for g, nm in zip(gpus, nms)))


def manual_layout(cluster: Cluster, profiles: Sequence[UnitProfile], num_vws: int,
                  stages: int | Sequence[int], nm: int | Sequence[int] | str, cuts: Sequence[Sequence[int]] | None,
                  costs: CostContext, model_name: str) -> Layout:
  """The layout of ``num_vws`` virtual workers with ``stages`` GPUs each (in cluster order), ``nm``, and
  ``cuts`` (one boundary list for all, or one per virtual worker; None: the fastest cuts at ``precision``).

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
    return fastest_cuts(cluster, profiles, gpus, nms, costs)
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
  return recomputed(cluster, profiles, Layout(tuple(VWLayout(tuple(g), tuple(c), n)
                                                   for g, c, n in zip(gpus, cut_lists, nms))), costs)


def recomputed(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, costs: CostContext) -> Layout:
  """``layout`` with each stage's activation recomputation chosen as the planner chooses it for its cuts
  (:func:`hetpipe_jax.plan.vw_plan.vw_plan`: of the modes ``costs.recompute`` allows, the fastest that fits)."""
  if costs.recompute == "none":
    return layout
  return Layout(tuple(vw_plan(cluster, profiles, vw.gpus, vw.cuts, vw.nm, costs, vw.window).layout
                      for vw in layout.vws))


def grouped_layout(cluster: Cluster, profiles: Sequence[UnitProfile], groups: Sequence[Sequence[int]],
                   cuts: Sequence[Sequence[int]], nm: int | Sequence[int], costs: CostContext = DEFAULT_COSTS,
                   window: int | Sequence[int] | None = None) -> Layout:
  """An explicit layout: each virtual worker's GPUs by cluster index in pipeline order, its cuts, Nm and
  window (what a tuned plan file holds). Nothing is searched; every stage must fit its GPU's memory (at
  ``precision``).

  Raises:
    ConfigError: naming the bad value, its limit and the fix.
  """
  num_units = len(profiles)
  flat = [i for group in groups for i in group]
  if not groups or not all(groups) or len(set(flat)) != len(flat) or not all(0 <= i < cluster.num_gpus
                                                                              for i in flat):
    raise ConfigError(f"grouping {[list(g) for g in groups]} must use each GPU index 0..{cluster.num_gpus - 1} "
                      "at most once, in non-empty groups")
  nms = per_vw("nm", nm, len(groups))
  if len(cuts) != len(groups):
    raise ConfigError(f"cuts has {len(cuts)} entries for {len(groups)} virtual workers; give one boundary "
                      "list per virtual worker")
  for i, (cut, group, n) in enumerate(zip(cuts, groups, nms)):
    if n < 1:
      raise ConfigError(f"Nm={n} for virtual worker {i}; Nm (minibatches in flight) must be >= 1")
    if (len(cut) != len(group) + 1 or cut[0] != 0 or cut[-1] != num_units
        or any(a >= b for a, b in zip(cut, cut[1:]))):
      raise ConfigError(f"cuts {list(cut)} of virtual worker {i} must be {len(group) + 1} increasing "
                        f"boundaries from 0 to {num_units} (one non-empty stage per GPU)")
  layout = Layout(tuple(VWLayout(tuple(cluster.gpus[g] for g in group), tuple(cut), n)
                        for group, cut, n in zip(groups, cuts, nms))).with_windows(window)
  layout = recomputed(cluster, profiles, layout, costs)
  check_memory(profiles, layout, costs)
  return layout
