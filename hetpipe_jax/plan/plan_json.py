"""A cluster plan as JSON (everything needed to recheck it from its own numbers) and as a readable table
(experiments/plan.py, :func:`hetpipe_jax.api.plan_hetpipe`)."""

from __future__ import annotations

import collections
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
                 batch_size: int, precision: str = "fp32", simulated: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
  """A plan with its inputs: per virtual worker its devices, Nm, window (None: Nm in flight) and the minibatches
  in flight its stages' memory holds, its stages (with the partner GPUs tensor parallelism splits a stage over:
  ``tp_devices``; time and memory per GPU of the stage), times, memory; per layer its costs;
  the GPU types and links, and which of them the plan uses.

  ``images_per_s`` is the simulator's figure when ``simulated`` is given, else the planner's bound
  (``bound_images_per_s``: every virtual worker at its own pipeline's rate, no WSP waiting, no shared link;
  see :mod:`hetpipe_jax.sim.planned`).

  Args:
    cluster: the cluster the plan is for.
    profiles: per-unit profiles of the model.
    plan: the plan.
    model: the model's name.
    batch_size: examples per minibatch (for images per second).
    precision: "fp32", "fp16" or "bf16", as planned.
    simulated: what the simulator measured of the plan (:meth:`hetpipe_jax.sim.planned.SimulatedPlan.to_json`),
      or None.

  Returns:
    A JSON-serialisable dict.
  """
  types = sorted({g.type.name for g in cluster.gpus}, key=str)
  gpu = lambda g: {"name": g.name, "type": g.type.name, "node": g.node, "index": g.index}
  vws = []
  for p in plan.vws:
    layout = p.layout
    vws.append({
        "devices": [gpu(g) for g in p.gpus], "nm": p.nm, "window": p.window, "in_flight": p.in_flight,
        "stages": [{"device": s.gpu.name, "tp_devices": [g.name for g in layout.stage_gpus(j)[1:]],
                    "first_layer": s.first, "last_layer": s.last - 1, "time_s": s.seconds,
                    "memory_bytes": s.memory_bytes, "memory_limit_bytes": s.gpu.type.memory_bytes,
                    "recompute": s.recompute} for j, s in enumerate(p.stages)],
        "bottleneck_s": p.bottleneck_s, "latency_s": p.latency_s, "throughput": p.throughput,
        "images_per_s": p.throughput * batch_size,
        # a push's bytes: the wave's update, in 16 bits in mixed precision (a pull brings fp32 weights)
        "ps_cross_node_bytes_per_wave": int(ps_cross_node_bytes(profiles, p.layout, plan.shard_nodes,
                                                                cluster.num_nodes) * byte_scale(precision)),
    })
  gpu_types = {t: next(g.type for g in cluster.gpus if g.type.name == t) for t in types}
  bound = plan.throughput * batch_size
  return {
      "model": model, "batch_size": batch_size, "policy": plan.policy, "placement": plan.placement,
      "precision": precision, "cluster": cluster.name, "vws": vws,
      "images_per_s": simulated["images_per_s"] if simulated else bound, "bound_images_per_s": bound,
      "simulated": simulated, "gpus_used": gpus_used(plan), "links_used": links_used(plan, vws),
      "shard_nodes": list(plan.shard_nodes),
      "layers": [{"name": u.name, "time_s": {t: sum(unit_seconds(u, gpu_types[t], precision)) for t in types},
                  "fwd_flops": u.fwd_flops, "bwd_flops": u.bwd_flops, "param_bytes": u.param_bytes,
                  "activation_bytes": u.out_bytes, "kept_bytes": u.kept_bytes} for u in profiles],
      "gpu_types": {t: dataclasses.asdict(gt) for t, gt in gpu_types.items()},
      "links": {"intra_node": dataclasses.asdict(cluster.intra_node),
                "inter_node": dataclasses.asdict(cluster.inter_node)},
  }


def gpus_used(plan: ClusterPlan) -> list[dict[str, Any]]:
  """The GPUs of the plan's virtual workers (tensor-parallel partners included), per node:
  ``[{"node": n, "gpus": {type: count}}]``."""
  counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
  every = (g for p in plan.vws for j in range(len(p.stages)) for g in p.layout.stage_gpus(j))
  for g in sorted(every, key=lambda g: g.index):
    counts[g.node][g.type.name] += 1
  return [{"node": n, "gpus": dict(c)} for n, c in sorted(counts.items())]


def links_used(plan: ClusterPlan, vws: list[dict[str, Any]]) -> dict[str, list[str]]:
  """What crosses each link of the cluster in the plan (``intra_node``, ``inter_node``): activations and
  gradients between stages, the all-reduces of tensor-parallel stages, PS traffic (pushes and pulls); an empty
  list: the plan does not use it."""
  hops = [(a.node == b.node) for p in plan.vws for a, b in zip(p.gpus, p.gpus[1:])]
  split = any(p.tp is not None for p in plan.vws)
  return {"intra_node": (["activations"] if any(hops) else []) + (["all-reduces"] if split else []),
          "inter_node": (["activations"] if not all(hops) else [])
                        + (["PS traffic"] if any(vw["ps_cross_node_bytes_per_wave"] for vw in vws) else [])}


def _hardware_lines(doc: dict[str, Any]) -> list[str]:
  """The GPUs and links a plan document names (:func:`plan_to_json`), as text."""
  gpus = "; ".join(f"node {n['node']}: " + ", ".join(f"{c} x {t}" for t, c in n["gpus"].items())
                   for n in doc["gpus_used"])
  link = lambda key: (f"{doc['links'][key]['name']} ({doc['links'][key]['bytes_per_s'] / 1e9:.3g} GB/s, "
                      f"{doc['links'][key]['latency_s'] * 1e6:.3g} us): "
                      + (", ".join(doc["links_used"][key]) or "unused"))
  return [f"GPUs used: {gpus}", f"links: intra-node {link('intra_node')}; inter-node {link('inter_node')}"]


def plan_table(doc: dict[str, Any]) -> str:
  """A plan document (:func:`plan_to_json`) as text: the totals (the simulator's images/s when the plan was
  simulated, and the planner's bound), the GPUs and links it uses, then per virtual worker its Nm,
  bottleneck, images/s and PS traffic, and a table of its stages (GPU, with its tensor-parallel partners'
  indices after '+', layers, time per minibatch, memory used per GPU and the GPU's limit, activation
  recomputation)."""
  sim = doc.get("simulated")
  bound = (f"planner's bound {doc['bound_images_per_s']:.1f} (each virtual worker at its own pipeline's rate, no "
           "WSP waiting, no shared link)")
  total = (f"simulated {sim['images_per_s']:.1f} images/s in total (sim executor, {sim['waves']} waves, "
           f"D={sim['d']}); {bound}" if sim else f"not simulated: {bound}")
  lines = [f"{doc['model']} (batch {doc['batch_size']}, {doc['precision']}) on {doc['cluster']}: policy "
           f"{doc['policy']}, placement {doc['placement']}, {total}", *_hardware_lines(doc)]
  for i, vw in enumerate(doc["vws"]):
    simulated = f" (simulated {sim['vw_images_per_s'][i]:.1f})" if sim else ""
    window = f" (window {vw['window']})" if vw.get("window") else ""
    lines.append(f"virtual worker {i}: Nm={vw['nm']}{window}  bottleneck {vw['bottleneck_s'] * 1e3:.1f} ms  "
                 f"{vw['images_per_s']:.1f} images/s alone{simulated}  PS traffic across nodes "
                 f"{vw['ps_cross_node_bytes_per_wave'] / 2**20:.1f} MiB per push")
    lines.append(f"  {'stage':>5} {'device':24} {'layers':>9} {'time ms':>8} {'memory GiB used / limit':>24} "
                 f"{'recompute':>9}")
    for j, s in enumerate(vw["stages"]):
      device = s["device"] + "".join(f"+{name.rsplit('.', 1)[1]}" for name in s.get("tp_devices", ()))
      lines.append(f"  {j:>5} {device:24} {s['first_layer']:>4}..{s['last_layer']:<4} "
                   f"{s['time_s'] * 1e3:8.1f} {s['memory_bytes'] / 2**30:11.2f} / "
                   f"{s['memory_limit_bytes'] / 2**30:<10.2f} {s.get('recompute', 'none'):>9}")
  return "\n".join(lines)
