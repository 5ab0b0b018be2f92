"""Layouts a user gives by hand: virtual workers of ``stages`` GPUs each, taken in cluster order, cut at
``cuts`` or, without cuts, by the partitioner for the fastest stages in that GPU order; or, with
:func:`grouped_layout`, every virtual worker's GPUs, order, cuts and Nm given (a tuned plan)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu, assign_gpus
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.costmodel import check_memory
from hetpipe_jax.plan.layout import Layout, VWLayout, per_vw
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.plan.tensor_groups import lead_cluster
from hetpipe_jax.plan.vw_plan import vw_plan


def fastest_cuts(cluster: Cluster, profiles: Sequence[UnitProfile], gpus: Sequence[Sequence[Gpu]],
                 nms: Sequence[int], costs: CostContext = DEFAULT_COSTS) -> Layout:
  """Each virtual worker's GPUs kept in the given order, cut by the partitioner for the fastest stages
  (at ``precision``: its stage times and memory).

  Raises:
    ConfigError: when no cut of a virtual worker fits its GPUs' memory.
  """
  return Layout(tuple(partition(cluster, profiles, g, nm, costs, ordered=True).layout for g, nm in zip(gpus, nms)))


def manual_layout(cluster: Cluster, profiles: Sequence[UnitProfile], ks: Sequence[int],
                  nm: int | Sequence[int] | str, cuts: Sequence[Sequence[int]] | None, costs: CostContext,
                  model_name: str, tp: int = 1) -> Layout:
  """The layout of virtual workers with ``ks[i]`` stages each, every stage on ``tp`` GPUs (tensor parallelism,
  :mod:`hetpipe_jax.tensor`; GPUs of one node and type), taken in cluster order, with ``nm`` and ``cuts`` (one
  boundary list for all, or one per virtual worker; None: the fastest cuts at ``precision``; a split stage is
  priced by its share of the compute and memory per GPU, without its all-reduces, which the cost model adds).

  Raises:
    ConfigError: naming the bad value, its limit and the fix.
  """
  num_units, num_vws = len(profiles), len(ks)
  if num_vws < 1:
    raise ConfigError(f"num_vws={num_vws}; at least 1 virtual worker is needed")
  if isinstance(nm, str):
    raise ConfigError(f"nm={nm!r} picks Nm from a plan; give a number, or a policy (NP, ED, HD)")
  if tp < 1:
    raise ConfigError(f"tp={tp}; the GPUs a stage is split over must be >= 1 (1: no tensor parallelism)")
  nms = per_vw("nm", nm, num_vws)
  for i, n in enumerate(nms):
    if n < 1:
      raise ConfigError(f"Nm={n} for virtual worker {i}; Nm (minibatches in flight) must be >= 1")
  for i, k in enumerate(ks):
    if k > num_units:
      raise ConfigError(f"virtual worker {i} has {k} stages but model {model_name} has only {num_units} "
                        f"units to cut; use at most {num_units} stages")
  if tp > 1 and sum(ks) * tp > cluster.num_gpus:
    fit = cluster.num_gpus // (max(ks) * tp)
    hint = f"num_vws={fit} with these stages, " if fit else ""
    raise ConfigError(f"{num_vws} virtual workers of {list(ks)} stages on tp={tp} GPUs each need {sum(ks) * tp} GPUs, "
                      f"but cluster {cluster.name!r} has {cluster.num_gpus}; use fewer virtual workers ({hint}say) "
                      "or stages, or a smaller tp")
  spans = assign_gpus(cluster, [k * tp for k in ks])  # raises when the cluster is too small
  gpus = [span[::tp] for span in spans]
  partners = [[tuple(span[j * tp + 1:(j + 1) * tp]) for j in range(k)] for span, k in zip(spans, ks)]
  planning = profiles if tp == 1 else [u.split(tp) for u in profiles]  # per GPU of a split stage
  if cuts is None:
    return with_partners(profiles, fastest_cuts(cluster, planning, gpus, nms, costs), partners, costs)
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
  layout = recomputed(cluster, planning, Layout(tuple(VWLayout(tuple(g), tuple(c), n)
                                                     for g, c, n in zip(gpus, cut_lists, nms))), costs)
  return with_partners(profiles, layout, partners, costs)


def with_partners(profiles: Sequence[UnitProfile], layout: Layout, partners: Sequence[Sequence[tuple[Gpu, ...]]],
                  costs: CostContext) -> Layout:
  """``layout`` with each stage split over its partner GPUs too (one tuple per stage of each virtual worker),
  checked to fit memory per GPU (``layout`` itself when no stage has partners).

  Raises:
    ConfigError: for partners of another node or type, or a stage that does not fit.
  """
  if not any(any(p) for p in partners):
    return layout
  layout = Layout(tuple(dataclasses.replace(vw, tp=tuple(p)) for vw, p in zip(layout.vws, partners)))
  check_memory(profiles, layout, costs)
  return layout


def recomputed(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, costs: CostContext) -> Layout:
  """``layout`` with each stage's activation recomputation chosen as the planner chooses it for its cuts
  (:func:`hetpipe_jax.plan.vw_plan.vw_plan`: of the modes ``costs.recompute`` allows, the fastest that fits)."""
  if costs.recompute == "none":
    return layout
  return Layout(tuple(vw_plan(cluster, profiles, vw.gpus, vw.cuts, vw.nm, costs, vw.window, vw.tp or None).layout
                      for vw in layout.vws))


def grouped_layout(cluster: Cluster, profiles: Sequence[UnitProfile], groups: Sequence[Sequence[int]],
                   cuts: Sequence[Sequence[int]], nm: int | Sequence[int], costs: CostContext = DEFAULT_COSTS,
                   window: int | Sequence[int] | None = None, tp: int = 1) -> Layout:
  """An explicit layout: each virtual worker's GPUs by cluster index in pipeline order, its cuts, Nm and
  window (what a tuned plan file holds). Nothing is searched; every stage must fit its GPU's memory (at
  ``precision``). With ``tp`` > 1 the GPUs named are the leads of groups of ``tp``
  (:func:`hetpipe_jax.plan.tensor_groups.lead_cluster`, as the tuner names them), and each stage takes its lead's
  partners.

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
  partners = _partners_of_leads(cluster, flat, tp)
  layout = Layout(tuple(VWLayout(tuple(cluster.gpus[g] for g in group), tuple(cut), n,
                                 tp=tuple(partners[g] for g in group) if tp > 1 else None)
                        for group, cut, n in zip(groups, cuts, nms))).with_windows(window)
  layout = recomputed(cluster, profiles, layout, costs)
  check_memory(profiles, layout, costs)
  return layout


def _partners_of_leads(cluster: Cluster, named: Sequence[int], tp: int) -> dict[int, tuple[Gpu, ...]]:
  """Each named GPU's partners at degree ``tp`` (none at 1).

  Raises:
    ConfigError: for a degree the cluster's nodes do not divide, or a named GPU that leads no group.
  """
  if tp == 1:
    return {}
  _, partners = lead_cluster(cluster, tp)
  for i in named:
    if cluster.gpus[i].index not in partners:
      leads = sorted(partners)
      raise ConfigError(f"tp={tp}: GPU {i} ({cluster.gpus[i].name}) is not the first GPU of its group of {tp} (a "
                        f"node's GPUs of one type in cluster order); name the groups' leads: {leads[:16]}"
                        f"{' ...' if len(leads) > 16 else ''}")
  return partners
