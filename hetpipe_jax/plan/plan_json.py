"""A cluster plan as JSON (everything needed to recheck it from its own numbers) and as a readable table
(experiments/plan.py, :func:`hetpipe_jax.api.plan_hetpipe`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.roofline import unit_seconds
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.plan.placement import ps_cross_node_bytes
from hetpipe_jax.precision import byte_scale

if TYPE_CHECKING:
  from hetpipe_jax.plan.allocation import ClusterPlan


def plan_to_json(cluster: Cluster, profiles: Sequence[UnitProfile], plan: ClusterPlan, model: str,
                 batch_size: int, precision: str = "fp32") -> dict[str, Any]:
  """A plan with its inputs: per virtual worker its devices, stages, times, memory; per layer its costs;
  the GPU types and links.

  Args:
    cluster: the cluster the plan is for.
    profiles: per-unit profiles of the model.
    plan: the plan.
    model: the model's name.
    batch_size: examples per minibatch (for images per second).
    precision: "fp32", "fp16" or "bf16", as planned.

  Returns:
    A JSON-serialisable dict.
  """
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
        # a push's bytes: the wave's update, in 16 bits in mixed precision (a pull brings fp32 weights)
        "ps_cross_node_bytes_per_wave": int(ps_cross_node_bytes(profiles, p.layout, plan.shard_nodes,
                                                                cluster.num_nodes) * byte_scale(precision)),
    })
  gpu_types = {t: next(g.type for g in cluster.gpus if g.type.name == t) for t in types}
  return {
      "model": model, "batch_size": batch_size, "policy": plan.policy, "placement": plan.placement,
      "precision": precision, "cluster": cluster.name, "vws": vws,
      "images_per_s": plan.throughput * batch_size,
      "shard_nodes": list(plan.shard_nodes),
      "layers": [{"name": u.name, "time_s": {t: sum(unit_seconds(u, gpu_types[t], precision)) for t in types},
                  "fwd_flops": u.fwd_flops, "bwd_flops": u.bwd_flops, "param_bytes": u.param_bytes,
                  "activation_bytes": u.out_bytes, "kept_bytes": u.kept_bytes} for u in profiles],
      "gpu_types": {t: dataclasses.asdict(gt) for t, gt in gpu_types.items()},
      "links": {"intra_node": dataclasses.asdict(cluster.intra_node),
                "inter_node": dataclasses.asdict(cluster.inter_node)},
  }


def plan_table(doc: dict[str, Any]) -> str:
  """A plan document (:func:`plan_to_json`) as text: the totals, then per virtual worker its Nm,
  bottleneck, modelled images/s and PS traffic, and a table of its stages (GPU, layers, time per
  minibatch, memory used and the GPU's limit)."""
  lines = [f"{doc['model']} (batch {doc['batch_size']}, {doc['precision']}) on {doc['cluster']}: policy "
           f"{doc['policy']}, placement {doc['placement']}, modelled {doc['images_per_s']:.1f} images/s in total "
           "(no WSP waiting)"]
  for i, vw in enumerate(doc["vws"]):
    lines.append(f"virtual worker {i}: Nm={vw['nm']}  bottleneck {vw['bottleneck_s'] * 1e3:.1f} ms  "
                 f"{vw['images_per_s']:.1f} images/s  PS traffic across nodes "
                 f"{vw['ps_cross_node_bytes_per_wave'] / 2**20:.1f} MiB per push")
    lines.append(f"  {'stage':>5} {'device':24} {'layers':>9} {'time ms':>8} {'memory GiB used / limit':>24}")
    for j, s in enumerate(vw["stages"]):
      lines.append(f"  {j:>5} {s['device']:24} {s['first_layer']:>4}..{s['last_layer']:<4} "
                   f"{s['time_s'] * 1e3:8.1f} {s['memory_bytes'] / 2**30:11.2f} / "
                   f"{s['memory_limit_bytes'] / 2**30:<10.2f}")
  return "\n".join(lines)
