"""Named groupings of a cluster's GPUs into virtual workers: the fixed policies and the general ones."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import POLICIES, allocate, hd_pairs, split_pair

Grouping = tuple[str, list[list[Gpu]]]


def groupings(cluster: Cluster) -> list[Grouping]:
  """Named groupings of the cluster's GPUs into virtual workers: NP, ED, HD, ED with m GPUs of every type
  per virtual worker, every node split into s virtual workers, HD's node pairs split into p virtual
  workers (:mod:`hetpipe_jax.tune`); those a cluster cannot form are left out."""
  out: list[Grouping] = []
  for policy in POLICIES:
    with contextlib.suppress(ConfigError):  # a cluster the policy cannot split
      out.append((policy, allocate(cluster, policy)))
  out += _ed_multiples(cluster) + _node_splits(cluster)
  hd = next((groups for name, groups in out if name == "HD"), None)
  if hd is not None:
    out += _hd_pair_splits(cluster, hd)
  return out


def _ed_multiples(cluster: Cluster) -> list[Grouping]:
  """ED with m of every type per virtual worker (when every type has as many GPUs)."""
  by_type: dict[str, list[Gpu]] = collections.defaultdict(list)
  for g in cluster.gpus:
    by_type[g.type.name].append(g)
  counts = {len(gs) for gs in by_type.values()}
  if len(counts) != 1:
    return []
  n = counts.pop()
  return [(f"ED x{m}", [[g for gs in by_type.values() for g in gs[v * m:(v + 1) * m]] for v in range(n // m)])
          for m in range(2, n + 1) if n % m == 0]


def _node_splits(cluster: Cluster) -> list[Grouping]:
  """Every node split into s virtual workers (for every s that divides every node's GPU count)."""
  nodes = [cluster.node_gpus(n) for n in sorted({g.node for g in cluster.gpus})]
  sizes = {len(gs) for gs in nodes}
  return [(f"NP /{s}", [gs[p * (len(gs) // s):(p + 1) * (len(gs) // s)] for gs in nodes for p in range(s)])
          for s in range(2, max(sizes) + 1) if all(size % s == 0 for size in sizes)]


def _hd_pair_splits(cluster: Cluster, hd: list[list[Gpu]]) -> list[Grouping]:
  """HD's node pairs as one virtual worker, or split finer than HD does (those unlike HD itself)."""
  out: list[Grouping] = []
  pairs, odd = hd_pairs(cluster)
  for parts in range(1, max((min(len(a), len(b)) for a, b in pairs), default=0) + 1):  # (one node: no pair)
    if all(len(a) % parts == 0 and len(b) % parts == 0 for a, b in pairs):
      groups = [g for a, b in pairs for g in split_pair(a, b, parts)] + odd
      if sorted(map(_names, groups)) != sorted(map(_names, hd)):
        out.append((f"HD pairs /{parts}", groups))
  return out


def _names(group: Sequence[Gpu]) -> tuple[str, ...]:
  return tuple(g.name for g in group)
