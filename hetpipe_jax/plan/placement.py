"""Where the parameter server's shards live, and what a push or a pull then sends across nodes.

docs/PROTOCOL.md section 5 (our reading of the paper): one shard per unit. ``default`` spreads the shards over
all nodes, balancing parameter bytes (largest shard first onto the lightest node: O(U log U + U x nodes)
for U units); ``local`` puts the shard of a unit on the node that runs it in the most virtual workers:
under ED (one shared plan) that is the node running it in every VW, so push and pull never cross nodes;
under NP and HD it keeps the traffic of the VWs that agree local (O(U x GPUs)). ``striped`` (issue 12)
splits every unit's shard into equal byte ranges, one on every node: a push then sends 1/N of each unit
to each of N nodes, so no node's link carries more than its share however many virtual workers push
(with per-unit shards every virtual worker pushes a unit to the one node that holds it). Striped shards
are modelled by the ``sim`` executor; the ``multiprocess`` parameter server holds whole units.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout

PLACEMENTS = ("default", "local", "striped")
STRIPED = -1  # the "node" of a unit whose shard is striped over every node


def place_shards(cluster: Cluster, profiles: Sequence[UnitProfile], layout: Layout,
                 placement: str = "default") -> list[int]:
  """The node of every unit's PS shard.

  Args:
    cluster: the cluster (its nodes).
    profiles: per-unit profiles of the model (parameter bytes).
    layout: the run's layout (which node runs which unit, for ``local``).
    placement: "default", "local" or "striped" (see the module docstring).

  Returns:
    One node per unit (:data:`STRIPED` for every unit under ``striped``).

  Raises:
    ConfigError: for an unknown placement.
  """
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
  if placement == "striped":
    return [STRIPED] * len(profiles)
  raise ConfigError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")


def ps_cross_node_bytes(profiles: Sequence[UnitProfile], vw: VWLayout, shard_nodes: Sequence[int],
                        num_nodes: int) -> int:
  """Bytes one push (and one pull) of a virtual worker sends across nodes under a placement.

  Args:
    profiles: per-unit profiles of the model.
    vw: the virtual worker's layout.
    shard_nodes: the node of every unit's shard (:func:`place_shards`).
    num_nodes: the cluster's nodes (a striped shard keeps 1/num_nodes on the GPU's own node).

  Returns:
    The parameter bytes of the units whose shard is on another node than the GPU that runs them, and
    (num_nodes - 1)/num_nodes of those whose shard is striped.
  """
  total = 0
  for _, gpu, units in vw.stages():
    for u in units:
      if shard_nodes[u] == STRIPED:
        total += profiles[u].param_bytes * (num_nodes - 1) // num_nodes
      elif shard_nodes[u] != gpu.node:
        total += profiles[u].param_bytes
  return total
