"""Allocation: which GPUs form which virtual worker; a cluster's plan (docs/PROTOCOL.md section 5).

Our reading of the paper's policies:

* **NP** (node partition): one virtual worker per node. Fast intra-node pipelines, unequal VW speeds.
* **ED** (equal distribution): virtual worker v takes the v-th GPU of every type, so all VWs are alike and
  share one partition plan; every pipeline hop crosses nodes.
* **HD** (hybrid distribution): nodes ranked by speed are paired fastest with slowest; each pair splits
  into VWs holding an equal share of both nodes' GPUs, so VW speeds are close and hops inside a pair's
  node stay inside it.
* a user grouping: lists of GPU indices.

The Horovod-style baseline uses the GPUs that hold the whole model plus a minibatch (:func:`horovod_gpus`).

:func:`plan_cluster` allocates, partitions every virtual worker (:mod:`~hetpipe_jax.plan.partition`;
under ED once, the plan then copied onto the other VWs by GPU type) and places the PS shards
(:mod:`~hetpipe_jax.plan.placement`). Allocation is O(GPUs log GPUs); the partitions dominate. With Nm
policy ``speed`` every virtual worker is partitioned at every Nm up to its ``max_fit`` and its Nm is sized to
its speed against the others' (:mod:`~hetpipe_jax.plan.waves`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.cost.context import DEFAULT_COSTS, CostContext
from hetpipe_jax.cost.memory import stage_memory_bytes
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.partition import fitting_plans, plan_virtual_worker
from hetpipe_jax.plan.placement import place_shards
from hetpipe_jax.plan.tensor_groups import lead_cluster, tp_degrees, type_degrees
from hetpipe_jax.plan.vw_plan import VWPlan, vw_plan
from hetpipe_jax.plan.waves import speed_sized

POLICIES = ("NP", "ED", "HD")


def _node_speed(cluster: Cluster, node: int) -> float:
  gpus = cluster.node_gpus(node)
  return sum(g.type.fp32_flops * g.type.efficiency for g in gpus) / len(gpus)


def parse_policy(text: str) -> str | list[list[int]]:
  """Reads an allocation policy from a flag.

  Args:
    text: "NP", "ED", "HD", or a grouping of GPU indices written "0,1;2,3" (',' within a virtual worker,
      ';' between them).

  Returns:
    The policy name, or the grouping as lists of indices.

  Raises:
    ConfigError: for a grouping that is not integers.
  """
  if ";" not in text and "," not in text:
    return text
  try:
    return [[int(i) for i in group.split(",")] for group in text.split(";")]
  except ValueError:
    raise ConfigError(f"policy {text!r}: a grouping is GPU indices, ',' within a virtual worker and ';' "
                      "between them, e.g. 0,1;2,3") from None


def allocate(cluster: Cluster, policy: str | Sequence[Sequence[int]]) -> list[list[Gpu]]:
  """Groups the cluster's GPUs into virtual workers by ``policy`` (see the module docstring).

  Args:
    cluster: the cluster.
    policy: "NP", "ED", "HD", or lists of GPU indices.

  Returns:
    Per virtual worker, its GPUs (the partitioner then picks their pipeline order).

  Raises:
    ConfigError: for an unknown policy, a bad grouping, or a cluster the policy cannot split.
  """
  nodes = sorted({g.node for g in cluster.gpus})
  if not isinstance(policy, str):
    groups = [[int(i) for i in group] for group in policy]
    flat = [i for group in groups for i in group]
    bad = [i for i in flat if not 0 <= i < cluster.num_gpus]
    if bad or len(set(flat)) != len(flat) or not all(groups):
      raise ConfigError(f"grouping {groups} must use each GPU index 0..{cluster.num_gpus - 1} at most once, "
                        "in non-empty groups")
    return [[cluster.gpus[i] for i in group] for group in groups]
  if policy == "NP":
    return [cluster.node_gpus(n) for n in nodes]
  if policy == "ED":
    by_type: dict[str, list[Gpu]] = {}
    for g in cluster.gpus:
      by_type.setdefault(g.type.name, []).append(g)
    counts = {t: len(gs) for t, gs in by_type.items()}
    if len(set(counts.values())) != 1:
      raise ConfigError(f"ED gives every virtual worker one GPU of each type, so it needs the same number of "
                        f"GPUs of every type; cluster {cluster.name!r} has {counts}; use NP, HD or a grouping")
    return [[gs[v] for gs in by_type.values()] for v in range(next(iter(counts.values())))]
  if policy == "HD":
    pairs, odd = hd_pairs(cluster)
    groups = []
    for fast, slow in pairs:
      parts = max(1, min(len(fast), len(slow)) // 2)
      if len(fast) % parts or len(slow) % parts:
        raise ConfigError(f"HD splits a node pair into {parts} virtual workers, but its nodes have "
                          f"{len(fast)} and {len(slow)} GPUs; use NP, ED or a grouping")
      groups += split_pair(fast, slow, parts)
    return groups + odd
  raise ConfigError(f"unknown allocation policy {policy!r}; use one of {', '.join(POLICIES)} or a grouping")


def hd_pairs(cluster: Cluster) -> tuple[list[tuple[list[Gpu], list[Gpu]]], list[list[Gpu]]]:
  """HD's node pairs, the fastest node with the slowest, then inwards; and the odd node out (alone, as
  under NP), if any."""
  ranked = sorted(sorted({g.node for g in cluster.gpus}), key=lambda n: -_node_speed(cluster, n))
  pairs = []
  while len(ranked) >= 2:
    pairs.append((cluster.node_gpus(ranked.pop(0)), cluster.node_gpus(ranked.pop(-1))))
  return pairs, [cluster.node_gpus(n) for n in ranked]


def split_pair(fast: Sequence[Gpu], slow: Sequence[Gpu], parts: int) -> list[list[Gpu]]:
  """A node pair as ``parts`` virtual workers, each an equal share of both nodes' GPUs."""
  a, b = len(fast) // parts, len(slow) // parts
  return [list(fast[p * a:(p + 1) * a]) + list(slow[p * b:(p + 1) * b]) for p in range(parts)]


def horovod_gpus(cluster: Cluster, profiles: Sequence[UnitProfile], costs: CostContext = DEFAULT_COSTS) -> list[Gpu]:
  """The GPUs that can train the whole model alone: weights, gradient, optimizer slots, one minibatch.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model at the training batch size.
    costs: optimizer slots and precision (:func:`hetpipe_jax.cost.memory.param_copies`; one minibatch in
      flight, so the weight mode does not matter).

  Returns:
    Those GPUs, in cluster order (the model as one stage at Nm = 1 fits their memory).
  """
  need = stage_memory_bytes(profiles, 1, costs._replace(weight_mode="latest"))
  return [g for g in cluster.gpus if g.type.memory_bytes >= need]


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
  """Virtual workers, their partitions and Nm, and the node of every PS shard."""

  policy: str
  placement: str
  vws: tuple[VWPlan, ...]
  shard_nodes: tuple[int, ...]

  @property
  def layout(self) -> Layout:
    """The virtual workers' GPUs, cuts and Nm."""
    return Layout(tuple(p.layout for p in self.vws))

  @property
  def throughput(self) -> float:
    """Modelled minibatches per second of all virtual workers together (no WSP waiting)."""
    return sum(p.throughput for p in self.vws)


def layout_plan(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout, policy: str = "manual",
                placement: str = "default", costs: CostContext = DEFAULT_COSTS) -> ClusterPlan:
  """The plan of a given layout: every virtual worker's stage times and memory, and the PS shards placed.

  The plan :func:`plan_cluster` returns is ``layout_plan`` of its own layout; a layout from elsewhere (given
  cuts, a tuned plan) is evaluated the same way.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model at the training batch size.
    layout: every virtual worker's GPUs in pipeline order, cuts, Nm and window.
    policy: the name the plan records (how the layout was made).
    placement: "default", "local" or "striped" (:func:`hetpipe_jax.plan.placement.place_shards`).
    costs: what the memory of a stage holds, and the precision of its times and memory.

  Returns:
    The plan; nothing is checked against the GPUs' memory (each stage's need and limit are in it).
  """
  plans = tuple(vw_plan(cluster, profiles, vw.gpus, vw.cuts, vw.nm, costs, vw.window, vw.tp) for vw in layout.vws)
  return ClusterPlan(policy, placement, plans, tuple(place_shards(cluster, profiles, layout, placement)))


def _same_plan_on(cluster: Cluster, profiles: Sequence[UnitProfile], template: VWPlan, gpus: Sequence[Gpu],
                  costs: CostContext) -> VWPlan:
  """``template``'s stage order by GPU type and its cuts, on another VW with the same types (ED)."""
  free = list(gpus)
  order = []
  for stage in template.stages:
    gpu = next(g for g in free if g.type.name == stage.gpu.type.name)
    free.remove(gpu)
    order.append(gpu)
  return vw_plan(cluster, profiles, order, template.cuts, template.nm, costs)


def _speed_sized_plans(cluster: Cluster, profiles: Sequence[UnitProfile], groups: Sequence[Sequence[Gpu]],
                       policy: str | Sequence[Sequence[int]], nm_max: int | None, costs: CostContext) -> list[VWPlan]:
  """Nm policy ``speed`` (:func:`hetpipe_jax.plan.waves.speed_sized`): every virtual worker partitioned at every
  Nm up to its max_fit (ED: the first one's plans copied onto the others), then its waves sized to its speed."""
  first = fitting_plans(cluster, profiles, groups[0], nm_max, costs)
  if policy == "ED":
    per_vw = [first] + [{n: _same_plan_on(cluster, profiles, p, g, costs) for n, p in first.items()}
                        for g in groups[1:]]
  else:
    per_vw = [first] + [fitting_plans(cluster, profiles, g, nm_max, costs) for g in groups[1:]]
  return speed_sized(per_vw)


Knobs = tuple[str, str | int | Sequence[int], int | None]  # plan_cluster's placement, nm_policy, nm_max


def _split_plan(cluster: Cluster, profiles: Sequence[UnitProfile], policy: str | Sequence[Sequence[int]],
                knobs: Knobs, costs: CostContext, tp: int | str | Mapping[str, int]) -> ClusterPlan:
  """:func:`plan_cluster` at tensor-parallel degree ``tp`` > 1 or one per GPU type (planned on the groups'
  leads, then each stage given its lead's partners), at every degree that divides the cluster for "auto",
  keeping the fastest, or searched per type for "per_type" (:mod:`~hetpipe_jax.plan.tensor_groups`)."""
  if not isinstance(policy, str):
    raise ConfigError(f"tp={tp} with a grouping of GPU indices: a grouping names every stage's GPU; give a policy "
                      "(NP, ED or HD), or the layout by num_vws and stages")
  if tp == "auto":
    plans, error, degrees = [], None, tp_degrees(cluster)
    for degree in degrees:
      try:
        plans.append(_split_plan(cluster, profiles, policy, knobs, costs, degree) if degree > 1 else
                     plan_cluster(cluster, profiles, policy, knobs[0], knobs[1], knobs[2], costs))
      except ConfigError as e:
        error = e
    if not plans:
      raise ConfigError(f"tp=auto: no degree of {degrees} fits; at tp={degrees[-1]}: {error}")
    return max(plans, key=lambda p: p.throughput)  # the first of equals: the smaller degree
  if tp == "per_type":
    return _per_type_plan(cluster, profiles, policy, knobs, costs)
  if isinstance(tp, str):
    raise ConfigError(f"tp={tp!r}; give a degree (1, 2, 4, ...), auto or per_type")
  leads, partners = lead_cluster(cluster, tp)
  if isinstance(tp, int):
    lead_plan = plan_cluster(leads, [u.split(tp) for u in profiles], policy, knobs[0], knobs[1], knobs[2], costs)
  else:  # each unit split by its lead's type's degree (the partitioner's and vw_plan's CostContext.tp_by_type)
    lead_plan = plan_cluster(leads, profiles, policy, knobs[0], knobs[1], knobs[2],
                             costs._replace(tp_by_type=tuple(sorted(tp.items()))))
  layout = Layout(tuple(dataclasses.replace(vw, tp=tuple(partners[g.index] for g in vw.gpus))
                        for vw in lead_plan.layout.vws))
  return layout_plan(cluster, profiles, layout, policy, knobs[0], costs)


def _per_type_plan(cluster: Cluster, profiles: Sequence[UnitProfile], policy: str, knobs: Knobs,
                   costs: CostContext) -> ClusterPlan:
  """tp=per_type: from "auto"'s plan, each GPU type (in cluster order) takes whichever of its degrees plans
  fastest with the others' fixed, until a pass changes none (ties: the degree it has)."""
  best = _split_plan(cluster, profiles, policy, knobs, costs, "auto")
  uniform = max((vw.degree(j) for vw in best.layout.vws for j in range(vw.k)), default=1)
  degrees = {g.type.name: uniform for g in cluster.gpus}
  changed = True
  while changed:
    changed = False
    for name in list(degrees):
      for t in type_degrees(cluster, name):
        if t == degrees[name]:
          continue
        trial = {**degrees, name: t}
        try:
          plan = _split_plan(cluster, profiles, policy, knobs, costs, trial)
        except ConfigError:
          continue
        if plan.throughput > best.throughput * (1 + 1e-9):
          best, degrees, changed = plan, trial, True
  return best


def plan_cluster(cluster: Cluster, profiles: Sequence[UnitProfile], policy: str | Sequence[Sequence[int]],
                 placement: str = "default", nm_policy: str | int | Sequence[int] = "max_fit",
                 nm_max: int | None = None, costs: CostContext = DEFAULT_COSTS,
                 tp: int | str | Mapping[str, int] = 1) -> ClusterPlan:
  """Allocates virtual workers, partitions each (ED: one shared plan), and places the PS shards.

  Args:
    cluster: the cluster.
    profiles: per-unit profiles of the model at the training batch size.
    policy: "NP", "ED", "HD", or lists of GPU indices (:func:`allocate`).
    placement: "default", "local" or "striped" (:func:`hetpipe_jax.plan.placement.place_shards`).
    nm_policy / nm_max: how Nm is chosen (:func:`hetpipe_jax.plan.partition.plan_virtual_worker`; "speed":
      waves sized to each virtual worker's speed, some with a window, :mod:`~hetpipe_jax.plan.waves`), or one
      Nm per virtual worker.
    costs: what the memory of a stage holds, and the precision of its times and memory
      (:class:`~hetpipe_jax.cost.context.CostContext`).
    tp: every stage's tensor-parallel degree (GPUs of one node and type), one per GPU type (a mapping), "auto":
      the degree of the fastest plan, or "per_type": the fastest degree per type found
      (:mod:`~hetpipe_jax.plan.tensor_groups`).

  Returns:
    The plan.

  Raises:
    ConfigError: for a bad policy, placement or degree, or a virtual worker that no partition fits.
  """
  if tp != 1:
    return _split_plan(cluster, profiles, policy, (placement, nm_policy, nm_max), costs, tp)
  groups = allocate(cluster, policy)
  kwargs = {"nm_max": nm_max, "costs": costs}
  if not isinstance(nm_policy, (str, int)):
    nms = [int(n) for n in nm_policy]
    if len(nms) != len(groups):
      raise ConfigError(f"nm has {len(nms)} values {nms} for the {len(groups)} virtual workers of policy "
                        f"{policy!r}; give one value, or one per virtual worker")
    plans = [plan_virtual_worker(cluster, profiles, g, n, **kwargs) for g, n in zip(groups, nms)]
  elif nm_policy == "speed":
    plans = _speed_sized_plans(cluster, profiles, groups, policy, nm_max, costs)
  elif policy == "ED":
    first = plan_virtual_worker(cluster, profiles, groups[0], nm_policy, **kwargs)
    plans = [first] + [_same_plan_on(cluster, profiles, first, g, costs)
                       for g in groups[1:]]
  else:
    plans = [plan_virtual_worker(cluster, profiles, g, nm_policy, **kwargs) for g in groups]
  name = policy if isinstance(policy, str) else "custom"
  layout = Layout(tuple(p.layout for p in plans))
  return ClusterPlan(name, placement, tuple(plans), tuple(place_shards(cluster, profiles, layout, placement)))
