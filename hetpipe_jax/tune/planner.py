"""Partitions of virtual workers at every Nm that fits, shared by alike virtual workers (:class:`Planner`);
the Nm choices per virtual worker (:func:`nm_choices`); a tuned configuration on a larger cluster
(:func:`replicate`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.partition import fitting_plans, partition
from hetpipe_jax.plan.vw_plan import VWPlan, vw_plan
from hetpipe_jax.plan.waves import sized_to, windowed
from hetpipe_jax.tune.candidate import Candidate
from hetpipe_jax.tune.groupings import groupings
from hetpipe_jax.tune.options import RunSetting

NmChoice = tuple[str, tuple[VWPlan, ...]]  # (rule, a plan per virtual worker)


def alike_key(gpus: Sequence[Gpu]) -> tuple:
  """Alike virtual workers share this key: the same GPU types, split over nodes the same way."""
  by_node: dict[int, list[str]] = collections.defaultdict(list)
  for g in gpus:
    by_node[g.node].append(g.type.name)
  return tuple(sorted(tuple(sorted(types)) for types in by_node.values()))


class Planner:
  """Partitions of virtual workers at every Nm that fits, shared by alike virtual workers."""

  def __init__(self, cluster: Cluster, profiles: Sequence[UnitProfile], nm_max: int, setting: RunSetting):
    self.cluster, self.profiles, self.nm_max = cluster, profiles, nm_max
    self.kwargs = setting.plan_kwargs
    self._cache: dict[tuple, dict[int, VWPlan]] = {}
    self.partitions = 0

  def plans(self, gpus: Sequence[Gpu]) -> dict[int, VWPlan]:
    """Nm -> the fastest partition of ``gpus`` at that Nm, for every Nm <= nm_max that fits."""
    key = alike_key(gpus)
    template = self._cache.get(key)
    if template is not None:
      moved = {nm: self.move(p, gpus) for nm, p in template.items()}
      if all(m is not None for m in moved.values()):
        return {nm: m for nm, m in moved.items() if m is not None}
    try:
      out = fitting_plans(self.cluster, self.profiles, gpus, self.nm_max, **self.kwargs)
    except ConfigError:
      out = {}  # not even Nm = 1 fits
    self.partitions += len(out)
    self._cache.setdefault(key, out)
    return out

  def move(self, plan: VWPlan, gpus: Sequence[Gpu]) -> VWPlan | None:
    """``plan``'s order and cuts on alike GPUs (None when the copy is not exactly as fast)."""
    free = list(gpus)
    node_map: dict[int, int] = {}
    order = []
    for g in plan.gpus:
      match = next((h for h in free if h.type.name == g.type.name and node_map.get(g.node, h.node) == h.node
                    and (g.node in node_map or h.node not in node_map.values())), None)
      if match is None:
        return None
      node_map.setdefault(g.node, match.node)
      free.remove(match)
      order.append(match)
    moved = vw_plan(self.cluster, self.profiles, order, plan.cuts, plan.nm, window=plan.window, **self.kwargs)
    return moved if abs(moved.bottleneck_s - plan.bottleneck_s) <= 1e-12 * plan.bottleneck_s else None


def nm_choices(per_vw: Sequence[dict[int, VWPlan]], k_max: Sequence[int],
               wave_max: int | None = None) -> list[NmChoice]:
  """Nm per virtual worker, three ways (:mod:`hetpipe_jax.tune`): the same for all, the planner's max_fit
  (the largest Nm <= the virtual worker's stage count), sized to speed at every wave time w of the plans
  (:func:`hetpipe_jax.plan.waves.sized_to`: each virtual worker the most minibatches whose wave lasts at
  most w; the run's Nm policy ``speed`` is one such w, :mod:`hetpipe_jax.plan.waves`). With ``wave_max``,
  sized to speed may give a virtual worker waves of up to ``wave_max`` minibatches beyond the Nm its memory
  holds, with a window of the largest Nm that fits. Distinct choices only."""
  out: dict[tuple[int, ...], NmChoice] = {}

  def add(rule: str, nms: Sequence[int]) -> None:
    key = tuple(nms)
    if key not in out:
      out[key] = (rule, tuple(plans[n] for plans, n in zip(per_vw, nms)))

  add("max_fit", [max(n for n in plans if n <= max(k, 1)) for plans, k in zip(per_vw, k_max)])
  for n in sorted(set.intersection(*(set(p) for p in per_vw))):
    add("uniform", [n] * len(per_vw))
  if wave_max is not None:  # waves beyond what fits in flight, with a window of the largest that fits
    per_vw = [windowed(plans, wave_max) for plans in per_vw]
  wave_times = sorted({n / p.throughput for plans in per_vw for n, p in plans.items()})
  for w in wave_times:  # each virtual worker: the most minibatches whose wave lasts at most w
    sized = sized_to(per_vw, w)
    if sized is not None:
      add("speed-sized", [p.nm for p in sized])
  return list(out.values())


def replicate(candidate: Candidate, cluster: Cluster, profiles: Sequence[UnitProfile], *, nm_max: int = 16,
              setting: RunSetting | None = None) -> Candidate:
  """``candidate`` (tuned on a smaller cluster) on ``cluster``: its grouping formed there, every virtual
  worker given the GPU order, cuts and Nm of an alike one of ``candidate`` (the same GPU types, split over
  nodes the same way), and the same D, placement and transfer model. Alike virtual workers are planned
  once: O(virtual workers) after that (weak scaling of a tuned configuration). ``setting``: the run's
  weight mode, optimizer slots and precision (None: the defaults; its schedule is not used).

  Raises:
    ConfigError: when ``cluster`` cannot form the grouping, or forms a virtual worker unlike every one of
      ``candidate``.
  """
  formed = dict(groupings(cluster))
  if candidate.grouping not in formed:
    raise ConfigError(f"grouping {candidate.grouping!r} cannot be formed on cluster {cluster.name!r}; it "
                      f"forms {', '.join(formed)}")
  templates = {alike_key(p.gpus): p for p in candidate.plans}
  planner = Planner(cluster, profiles, nm_max, RunSetting() if setting is None else setting)
  plans = []
  for gpus in formed[candidate.grouping]:
    template = templates.get(alike_key(gpus))
    if template is None:
      raise ConfigError(f"virtual worker {', '.join(g.name for g in gpus)} of grouping {candidate.grouping!r} "
                        f"on {cluster.name!r} is like none of the tuned configuration's; tune on a cluster "
                        "with every kind of node")
    moved = planner.move(template, gpus)  # None when the copy would not be as fast: plan it at that Nm
    plans.append(moved or partition(cluster, profiles, gpus, template.in_flight, **planner.kwargs).with_wave(
        template.nm))
  return dataclasses.replace(candidate, plans=tuple(plans))
