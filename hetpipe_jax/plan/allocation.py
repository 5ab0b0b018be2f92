"""Allocation: which GPUs form which virtual worker, and where the parameter-server shards live.

HETPIPE.md section 5 (our reading of the paper):

* **NP** (node partition): one virtual worker per node. Fast intra-node pipelines, unequal VW speeds.
* **ED** (equal distribution): virtual worker v takes the v-th GPU of every type, so all VWs are alike and
  share one partition plan; every pipeline hop crosses nodes.
* **HD** (hybrid distribution): nodes ranked by speed are paired fastest with slowest; each pair splits
  into VWs holding an equal share of both nodes' GPUs, so VW speeds are close and hops inside a pair's
  node stay inside it.
* a user grouping: lists of GPU indices.

Parameter placement: ``default`` spreads the shards (units) over all nodes, balancing parameter bytes;
``local`` puts the shard of a unit on the node that runs it in the most VWs: under ED (one shared plan)
that is the node running it in every VW, so push and pull never cross nodes; under NP and HD it keeps
the traffic of the VWs that agree local. The Horovod-style baseline can use the GPUs that hold the whole model
plus a minibatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.cluster.topology import Cluster, Gpu
from hetpipe_jax.cost.profile import UnitProfile, stage_memory_bytes, stage_seconds
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.plan.partition import StagePlan, VWPlan, plan_virtual_worker

POLICIES = ("NP", "ED", "HD")
PLACEMENTS = ("default", "local")


def _node_speed(cluster: Cluster, node: int) -> float:
  gpus = cluster.node_gpus(node)
  return sum(g.type.fp32_flops * g.type.efficiency for g in gpus) / len(gpus)


def parse_policy(text: str) -> str | list[list[int]]:
  """"NP", "ED", "HD", or a grouping of GPU indices written "0,1;2,3" (',' within a VW, ';' between)."""
  if ";" not in text and "," not in text:
    return text
  try:
    return [[int(i) for i in group.split(",")] for group in text.split(";")]
  except ValueError:
    raise ConfigError(f"policy {text!r}: a grouping is GPU indices, ',' within a virtual worker and ';' "
                      "between them, e.g. 0,1;2,3") from None


def allocate(cluster: Cluster, policy: str | Sequence[Sequence[int]]) -> list[list[Gpu]]:
  """Groups the cluster's GPUs into virtual workers by ``policy`` (NP, ED, HD, or lists of indices).

  Raises:
    ConfigError: for an unknown policy, or a cluster the policy cannot split.
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
    ranked = sorted(nodes, key=lambda n: -_node_speed(cluster, n))
    groups = []
    while len(ranked) >= 2:
      fast, slow = cluster.node_gpus(ranked.pop(0)), cluster.node_gpus(ranked.pop(-1))
      parts = max(1, min(len(fast), len(slow)) // 2)
      if len(fast) % parts or len(slow) % parts:
        raise ConfigError(f"HD splits a node pair into {parts} virtual workers, but its nodes have "
                          f"{len(fast)} and {len(slow)} GPUs; use NP, ED or a grouping")
      a, b = len(fast) // parts, len(slow) // parts
      groups += [fast[p * a:(p + 1) * a] + slow[p * b:(p + 1) * b] for p in range(parts)]
    if ranked:  # an odd node out runs alone (NP)
      groups.append(cluster.node_gpus(ranked[0]))
    return groups
  raise ConfigError(f"unknown allocation policy {policy!r}; use one of {', '.join(POLICIES)} or a grouping")


def place_shards(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout,
                 placement: str = "default") -> list[int]:
  """The node of every unit's PS shard under ``placement`` (default or local)."""
  if placement == "default":
    nodes = sorted({g.node for g in cluster.gpus})
    load = dict.fromkeys(nodes, 0)
    out = [0] * len(profiles)
    for u in sorted(range(len(profiles)), key=lambda u: -profiles[u].param_bytes):
      out[u] = min(nodes, key=lambda n: (load[n], n))  # largest shards first, onto the lightest node
      load[out[u]] += profiles[u].param_bytes
    return out
  if placement == "local":  # the node that runs the unit in the most virtual workers
    out = []
    for u in range(len(profiles)):
      homes = [gpu.node for vw in layout.vws for _, gpu, units in vw.stages() if u in units]
      out.append(min(set(homes), key=lambda n: (-homes.count(n), n)))
    return out
  raise ConfigError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")


def ps_cross_node_bytes(profiles: Sequence[UnitProfile], vw: VWLayout, shard_nodes: Sequence[int]) -> int:
  """Bytes one push (and one pull) of a virtual worker sends across nodes under a placement."""
  return sum(profiles[u].param_bytes for _, gpu, units in vw.stages() for u in units
             if shard_nodes[u] != gpu.node)


def horovod_gpus(cluster: Cluster, profiles: Sequence[UnitProfile], optimizer_slots: float = 0.0) -> list[Gpu]:
  """GPUs that can train the whole model alone (weights, gradient, optimizer slots, one minibatch)."""
  need = stage_memory_bytes(profiles, 1, "latest", optimizer_slots)
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


def _same_plan_on(cluster: Cluster, profiles, template: VWPlan, gpus: Sequence[Gpu], precision: str,
                  weight_mode: str, optimizer_slots: float) -> VWPlan:
  """``template``'s stage order by GPU type and its cuts, on another VW with the same types (ED)."""
  free = list(gpus)
  order = []
  for stage in template.stages:
    gpu = next(g for g in free if g.type.name == stage.gpu.type.name)
    free.remove(gpu)
    order.append(gpu)
  cuts = template.cuts
  stages = []
  for j, gpu in enumerate(order):
    fwd, bwd = stage_seconds(cluster, profiles, cuts, order, j, precision)
    stages.append(StagePlan(gpu, cuts[j], cuts[j + 1], fwd + bwd, stage_memory_bytes(
        profiles[cuts[j]:cuts[j + 1]], template.nm, weight_mode, optimizer_slots)))
  return VWPlan(template.nm, tuple(stages))


def plan_cluster(cluster: Cluster, profiles: Sequence[UnitProfile], policy: str | Sequence[Sequence[int]],
                 placement: str = "default", nm_policy: str | int = "max_fit", nm_max: int | None = None,
                 weight_mode: str = "stash", optimizer_slots: float = 0.0,
                 precision: str = "fp32") -> ClusterPlan:
  """Allocates virtual workers, partitions each (ED: one shared plan), and places the PS shards."""
  groups = allocate(cluster, policy)
  kwargs = dict(nm_policy=nm_policy, nm_max=nm_max, weight_mode=weight_mode,
                optimizer_slots=optimizer_slots, precision=precision)
  if policy == "ED":
    first = plan_virtual_worker(cluster, profiles, groups[0], **kwargs)
    plans = [first] + [_same_plan_on(cluster, profiles, first, g, precision, weight_mode, optimizer_slots)
                       for g in groups[1:]]
  else:
    plans = [plan_virtual_worker(cluster, profiles, g, **kwargs) for g in groups]
  name = policy if isinstance(policy, str) else "custom"
  layout = Layout(tuple(p.layout for p in plans))
  return ClusterPlan(name, placement, tuple(plans), tuple(place_shards(cluster, profiles, layout, placement)))


def plan_to_json(cluster: Cluster, profiles: Sequence[UnitProfile], plan: ClusterPlan, model: str,
                 batch_size: int, precision: str = "fp32") -> dict[str, Any]:
  """Everything needed to recheck a plan from its own numbers."""
  types = sorted({g.type.name for g in cluster.gpus}, key=str)
  gpu = lambda g: {"name": g.name, "type": g.type.name, "node": g.node, "index": g.index}
  vws = []
  for p in plan.vws:
    vws.append({
        "devices": [gpu(g) for g in p.gpus], "nm": p.nm,
        "stages": [{"device": s.gpu.name, "first_layer": s.first, "last_layer": s.last - 1,
                    "time_s": s.seconds, "memory_bytes": s.memory_bytes,
                    "memory_limit_bytes": s.gpu.type.memory_bytes} for s in p.stages],
        "bottleneck_s": p.bottleneck_s, "latency_s": p.latency_s, "throughput": p.throughput,
        "images_per_s": p.throughput * batch_size,
        "ps_cross_node_bytes_per_wave": ps_cross_node_bytes(profiles, p.layout, plan.shard_nodes),
    })
  gpu_types = {t: next(g.type for g in cluster.gpus if g.type.name == t) for t in types}
  return {
      "model": model, "batch_size": batch_size, "policy": plan.policy, "placement": plan.placement,
      "precision": precision, "cluster": cluster.name, "vws": vws,
      "images_per_s": plan.throughput * batch_size,
      "shard_nodes": list(plan.shard_nodes),
      "layers": [{"name": u.name, "time_s": {t: sum(u.seconds(gpu_types[t], precision)) for t in types},
                  "fwd_flops": u.fwd_flops, "bwd_flops": u.bwd_flops, "param_bytes": u.param_bytes,
                  "activation_bytes": u.out_bytes, "kept_bytes": u.kept_bytes} for u in profiles],
      "gpu_types": {t: dataclasses.asdict(gt) for t, gt in gpu_types.items()},
      "links": {"intra_node": dataclasses.asdict(cluster.intra_node),
                "inter_node": dataclasses.asdict(cluster.inter_node)},
  }
