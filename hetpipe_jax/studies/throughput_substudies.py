"""The throughput study's sub-studies outside the table, as rows of one model: ``nm`` (one virtual worker as Nm
grows), ``closed_form`` (the closed-form Horovod estimate), ``whimpy`` (HetPipe without the whimpy GPUs)
(:mod:`hetpipe_jax.studies.throughput`).
"""

from __future__ import annotations

from hetpipe_jax.baselines.horovod import horovod_images_per_second
from hetpipe_jax.cluster import make_cluster
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import allocate, horovod_gpus, plan_cluster
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.studies.throughput_records import ModelStudy
from hetpipe_jax.systems.hetpipe import rule_tag


def nm_rows(s: ModelStudy) -> None:
  """(a) one virtual worker, Nm = 1 .. nm_max."""
  ed, hd, nodes = allocate(s.cluster, "ED")[0], allocate(s.cluster, "HD")[0], allocate(s.cluster, "NP")
  mixes = {"ED mix (1 of each type)": ed, "HD mix (fast + whimpy)": hd,
           f"one node ({nodes[0][0].type.name})": nodes[0]}
  for label, gpus in mixes.items():
    for nm in range(1, s.config.nm_max + 1):
      try:
        plan = partition(s.cluster, s.profiles, gpus, nm, s.costs)
      except ConfigError:
        break  # memory grows with Nm
      s.row("nm", label, len(gpus), nm, 0, s.simulated_images_per_sec([plan]), s.ideal(gpus))
      s.say(f"{s.model_name} {label} Nm={nm}: {s.rows[-1].images_per_sec:.1f} images/s")


def closed_form_horovod(s: ModelStudy, study_name: str) -> None:
  """(b) the closed-form Horovod estimate on the GPUs that hold the model: its row (none when no GPU does)."""
  gpus = horovod_gpus(s.cluster, s.profiles, s.costs)
  if gpus:
    ips = horovod_images_per_second(s.cluster, s.profiles, gpus, s.batch, overlap=False)
    s.row(study_name, f"Horovod (closed form), {len(gpus)} GPUs that hold the model", len(gpus), 1, 0, ips,
          s.ideal(), "serial")


def whimpy_rows(s: ModelStudy) -> bool:
  """(c) whimpy GPUs: HetPipe on the others, HetPipe on all, at every Nm rule of ``config.nms`` (a rule other than
  max_fit named in the row; skipped when the cluster has no such GPUs or nothing else, or the model does not
  fit); whether it ran."""
  cluster, whimpy = s.cluster, s.config.whimpy
  kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
          if cluster.node_gpus(n)[0].type.name != whimpy]
  if not kept or len(kept) == len({g.node for g in cluster.gpus}):
    s.say(f"whimpy sub-study skipped: {cluster.name} has no nodes of {whimpy} GPUs, or only those")
    return False
  without = make_cluster(f"{cluster.name}-no-whimpy", kept, cluster.intra_node, cluster.inter_node)
  sides = [(f"HetPipe ED-local{rule_tag(rule)}, {c.num_gpus} GPUs{other}", c, rule)
           for rule in s.config.nms for c, other in ((without, f" (no {whimpy})"), (cluster, ""))]
  for label, c, rule in sides:
    try:
      plan = plan_cluster(c, s.profiles, "ED", "local", rule, None, s.costs)
    except ConfigError as e:
      s.say(f"whimpy sub-study skipped, {label}: {e}")
      return False
    s.row("whimpy", label, c.num_gpus, max(p.nm for p in plan.vws), 0,
          s.simulated_images_per_sec(plan.vws, 0, "local", c), s.ideal(cluster=c))
  return True

