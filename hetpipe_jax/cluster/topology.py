"""A cluster: GPUs grouped in nodes, one link inside a node and one between nodes; presets; grouping.

HetPipe's testbed (docs/PROTOCOL.md section 5) is 4 nodes x 4 GPUs of one type each. Here a cluster is a list
of GPUs (type + node, numbered in node order), an intra-node and an inter-node link; which link joins two
GPUs is :meth:`Cluster.link`. Presets name the clusters the experiments use; a TOML file describes any
other (:mod:`hetpipe_jax.cluster.toml`). Every GPU of a run is mapped onto one JAX device by its index.
"""

from __future__ import annotations

import dataclasses
import functools

from hetpipe_jax.cluster.catalogue import (
  CATALOGUE,
  CLASS_A,
  LINKS,
  PAPER_TYPES,
  SCALE_TYPES,
  SPEED_CLASSES,
  GpuType,
  Link,
)
from hetpipe_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU of a cluster: its index in the cluster, its type, its node."""

  index: int
  type: GpuType
  node: int

  @property
  def name(self) -> str:
    """``n<node>.<type>.<index>``, e.g. ``n0.TITAN_V.0``."""
    return f"n{self.node}.{self.type.name.replace(' ', '_')}.{self.index}"


@dataclasses.dataclass(frozen=True)
class Cluster:
  """GPUs grouped in nodes (in order), one link type inside a node and one between nodes."""

  name: str
  gpus: tuple[Gpu, ...]
  intra_node: Link = LINKS["pcie3"]
  inter_node: Link = LINKS["ib_fdr56"]

  @property
  def num_gpus(self) -> int:
    """The number of GPUs."""
    return len(self.gpus)

  @property
  def num_nodes(self) -> int:
    """The number of nodes."""
    return len({g.node for g in self.gpus})

  def node_gpus(self, node: int) -> list[Gpu]:
    """The GPUs of a node.

    Args:
      node: the node's number.

    Returns:
      Its GPUs, in cluster order.
    """
    return list(self._by_node.get(node, ()))

  @functools.cached_property
  def _by_node(self) -> dict[int, tuple[Gpu, ...]]:
    """Every node's GPUs, in cluster order (looked up once: planning 16,384 GPUs asks for a node's GPUs 12,288
    times, and scanning every GPU for each took 9 of its 13 s)."""
    by_node: dict[int, list[Gpu]] = {}
    for g in self.gpus:
      by_node.setdefault(g.node, []).append(g)
    return {node: tuple(gpus) for node, gpus in by_node.items()}

  def link(self, a: Gpu, b: Gpu) -> Link:
    """The link between two GPUs.

    Args:
      a / b: the GPUs.

    Returns:
      The intra-node link when they share a node, the inter-node link otherwise.
    """
    return self.intra_node if a.node == b.node else self.inter_node


def make_cluster(name: str, types_per_node: list[list[GpuType]], intra_node: Link = LINKS["pcie3"],
                 inter_node: Link = LINKS["ib_fdr56"]) -> Cluster:
  """A cluster from the GPU types of each node.

  Args:
    name: the cluster's name.
    types_per_node: for every node in order, the types of its GPUs; GPUs are numbered in this order.
    intra_node / inter_node: the links inside a node and between nodes.

  Returns:
    The cluster.
  """
  gpus, index = [], 0
  for node, types in enumerate(types_per_node):
    for gpu_type in types:
      gpus.append(Gpu(index=index, type=gpu_type, node=node))
      index += 1
  return Cluster(name, tuple(gpus), intra_node, inter_node)


PRESETS = {
    # The paper's testbed: 4 nodes x 4 GPUs of one type each, PCIe inside, 56 Gb/s InfiniBand between.
    "paper_testbed": lambda: make_cluster("paper_testbed", [[CATALOGUE[t]] * 4 for t in PAPER_TYPES]),
    # One GPU of each testbed type, one per node: the testbed's mix at CPU-emulation size.
    "paper_mini": lambda: make_cluster("paper_mini", [[CATALOGUE[t]] for t in PAPER_TYPES]),
    # Two of each testbed type, two per node.
    "paper_half": lambda: make_cluster("paper_half", [[CATALOGUE[t]] * 2 for t in PAPER_TYPES]),
    # Emulation classes A-D: 4 nodes x 2 GPUs, one class per node.
    "hetero4": lambda: make_cluster("hetero4", [[t, t] for t in SPEED_CLASSES]),
    "hetero4x4": lambda: make_cluster("hetero4x4", [[t] * 4 for t in SPEED_CLASSES]),
    "uniform8": lambda: make_cluster("uniform8", [[CLASS_A] * 4, [CLASS_A] * 4]),
    # A cloud-like mix: V100s with NVLink and T4s over 25 GbE.
    "v100_t4": lambda: make_cluster("v100_t4", [[CATALOGUE["V100"]] * 4, [CATALOGUE["T4"]] * 4],
                                    LINKS["nvlink2"], LINKS["eth25"]),
    # A heterogeneous datacenter (issue 38's large-model study): 32 nodes of 8 GPUs of one type, the 8 scale types
    # in turn (4 nodes each), NVLink 2 inside a node, 200 Gb/s InfiniBand HDR between.
    "datacenter256": lambda: make_cluster("datacenter256", [[CATALOGUE[SCALE_TYPES[n % 8]]] * 8 for n in range(32)],
                                          LINKS["nvlink2"], LINKS["ib_hdr200"]),
}


def mixed_cluster(num_gpus: int, per_node: int = 4) -> Cluster:
  """``num_gpus`` GPUs in nodes of ``per_node`` of one type, node i of type ``SCALE_TYPES[i % 8]`` (PCIe
  inside, 56 Gb/s InfiniBand between): the scaling clusters of issue 12, named ``mixed<N>`` (nodes of 4)
  or ``mixed<N>x<G>`` (nodes of G).

  Raises:
    ConfigError: unless ``num_gpus`` is a positive multiple of ``per_node``.
  """
  name = f"mixed{num_gpus}" + ("" if per_node == 4 else f"x{per_node}")
  if per_node < 1 or num_gpus < per_node or num_gpus % per_node:
    raise ConfigError(f"cluster {name}: {num_gpus} GPUs in nodes of {per_node}; use a positive multiple of "
                      f"the GPUs per node (e.g. mixed64 or mixed1024x8)")
  return make_cluster(name, [[CATALOGUE[SCALE_TYPES[n % len(SCALE_TYPES)]]] * per_node
                             for n in range(num_gpus // per_node)])


def assign_gpus(cluster: Cluster, stages_per_vw: list[int]) -> list[list[Gpu]]:
  """Groups the cluster's GPUs into virtual workers, in cluster order (node by node).

  Virtual worker i takes the next ``stages_per_vw[i]`` GPUs. On a preset whose nodes hold one type each
  this yields virtual workers of different speeds (the paper's NP policy when a virtual worker is a node).

  Args:
    cluster: the cluster.
    stages_per_vw: GPUs (= stages) of every virtual worker.

  Returns:
    Per virtual worker, its GPUs in pipeline order.

  Raises:
    ConfigError: when a virtual worker has no stage, or they need more GPUs than the cluster has.
  """
  for i, k in enumerate(stages_per_vw):
    if k < 1:
      raise ConfigError(f"virtual worker {i} has {k} stages; every virtual worker needs at least 1 stage")
  need = sum(stages_per_vw)
  if need > cluster.num_gpus:
    raise ConfigError(
        f"{len(stages_per_vw)} virtual workers with {stages_per_vw} stages need {need} GPUs, but cluster "
        f"{cluster.name!r} has {cluster.num_gpus}; use fewer virtual workers or stages, or a larger cluster "
        f"(known: {', '.join(sorted(PRESETS))})")
  groups, start = [], 0
  for k in stages_per_vw:
    groups.append(list(cluster.gpus[start:start + k]))
    start += k
  return groups
