"""The planner's view of tensor parallelism: every stage split over ``t`` GPUs of one node and type.

A cluster planned at tensor-parallel degree t is planned as the cluster of its groups' leads: each node's GPUs
of one type, in cluster order, form groups of t, and the first GPU of a group (its lead) stands for it, every
unit's profile split over t (:meth:`hetpipe_jax.cost.unit.UnitProfile.split`: a stage's time and memory are per
GPU of its group) and its all-reduces charged on the node's link
(:func:`hetpipe_jax.cost.transfer.split_allreduce_seconds`). The allocation policies and the exact partitioner
then run unchanged on the leads (the DP's signatures are (type, node), which a group keeps), and each stage takes
its lead's partners (:func:`hetpipe_jax.plan.allocation.plan_cluster`; the tuner alike, :mod:`hetpipe_jax.tune`).
Degree ``auto`` plans every degree of :data:`DEGREES` that divides the cluster's nodes and keeps the plan of the
largest modelled throughput (ties to the smaller degree): one degree for every stage (a node whose GPUs of a type
do not divide into groups of t rules that t out). Degree ``per_type`` searches a degree per GPU type, so a stage's
degree is its GPU type's: from ``auto``'s plan, each type in turn takes whichever of its degrees gives the
fastest plan with the others' fixed, until a pass over the types changes none (coordinate descent; a plan at
mixed degrees is planned on its leads with each unit split by its lead's type, ``CostContext.tp_by_type``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.errors import ConfigError

DEGREES = (1, 2, 4, 8)
SEARCHES = ("auto", "per_type")  # the degree searched: one for every stage, or one per GPU type
Degrees = int | Mapping[str, int]  # one degree for every stage, or one per GPU type (a type not named: 1)


def parse_tp(text: str | int) -> int | str:
  """A tensor-parallel degree from a flag: a positive integer, "auto" or "per_type".

  Raises:
    ConfigError: for anything else.
  """
  if text in SEARCHES or isinstance(text, int):
    value = text
  else:
    try:
      value = int(text)
    except ValueError:
      raise ConfigError(f"tp={text!r}; give the GPUs each stage is split over (1, 2, 4, ...), auto (the fastest "
                        "degree) or per_type (the fastest degree per GPU type)") from None
  if isinstance(value, int) and value < 1:
    raise ConfigError(f"tp={value}; the GPUs a stage is split over must be >= 1 (1: no tensor parallelism)")
  return value


def degree_for(degrees: Degrees, type_name: str) -> int:
  """The degree ``degrees`` gives stages on GPUs of type ``type_name``."""
  return degrees if isinstance(degrees, int) else degrees.get(type_name, 1)


def check_degree(cluster: Cluster, degree: Degrees) -> None:
  """Raises ConfigError unless every node's GPUs of each type divide into groups of its type's degree."""
  counts = Counter((g.node, g.type.name) for g in cluster.gpus)
  for (node, type_name), n in sorted(counts.items()):
    t = degree_for(degree, type_name)
    if n % t:
      fits = tp_degrees(cluster) if isinstance(degree, int) else type_degrees(cluster, type_name)
      raise ConfigError(f"tp={t}: node {node} of cluster {cluster.name!r} has {n} {type_name} GPUs, which do not "
                        f"divide into groups of {t} (a stage is split over GPUs of one node and type); use tp "
                        f"in {fits} or auto")


def tp_degrees(cluster: Cluster) -> list[int]:
  """The degrees of :data:`DEGREES` into which every node's GPUs of each type divide."""
  counts = Counter((g.node, g.type.name) for g in cluster.gpus).values()
  return [t for t in DEGREES if all(n % t == 0 for n in counts)]


def type_degrees(cluster: Cluster, type_name: str) -> list[int]:
  """The degrees of :data:`DEGREES` into which every node's GPUs of type ``type_name`` divide."""
  counts = Counter(g.node for g in cluster.gpus if g.type.name == type_name).values()
  return [t for t in DEGREES if all(n % t == 0 for n in counts)]


def lead_cluster(cluster: Cluster, degree: Degrees) -> tuple[Cluster, dict[int, tuple[Gpu, ...]]]:
  """The cluster of the groups' leads at ``degree`` (one, or one per GPU type), and each lead's partners by its
  index.

  Raises:
    ConfigError: when a node's GPUs of one type do not divide into groups of its degree.
  """
  check_degree(cluster, degree)
  groups: dict[tuple[int, str], list[Gpu]] = {}
  for g in cluster.gpus:
    groups.setdefault((g.node, g.type.name), []).append(g)
  partners = {}
  for (_, type_name), gpus in groups.items():
    t = degree_for(degree, type_name)
    for start in range(0, len(gpus), t):
      partners[gpus[start].index] = tuple(gpus[start + 1:start + t])
  leads = tuple(g for g in cluster.gpus if g.index in partners)
  name = degree if isinstance(degree, int) else ",".join(f"{k}:{v}" for k, v in sorted(degree.items()))
  return Cluster(f"{cluster.name} (tp={name} leads)", leads, cluster.intra_node, cluster.inter_node), partners
