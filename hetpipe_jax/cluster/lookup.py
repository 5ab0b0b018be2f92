"""A cluster by the name a user gives: a preset, ``mixed<N>[x<G>]``, or a TOML file.

Above both :mod:`~hetpipe_jax.cluster.topology` (presets, ``mixed_cluster``) and
:mod:`~hetpipe_jax.cluster.toml` (files), which build their clusters with ``topology.make_cluster``.
"""

from __future__ import annotations

import os
import re

from hetpipe_jax.cluster.toml import load_cluster_toml, nearest
from hetpipe_jax.cluster.topology import PRESETS, Cluster, mixed_cluster
from hetpipe_jax.errors import ConfigError

MIXED = re.compile(r"mixed(\d+)(?:x(\d+))?")


def get_cluster(name: str) -> Cluster:
  """A preset by name, ``mixed<N>[x<G>]`` (:func:`~hetpipe_jax.cluster.topology.mixed_cluster`), or a
  cluster from a TOML file.

  Args:
    name: a key of ``PRESETS``, ``mixed<N>[x<G>]``, or a path (ending in ``.toml`` or containing a path
      separator).

  Returns:
    The cluster.

  Raises:
    ConfigError: for an unknown name, listing the known ones, or a bad file.
  """
  if name.endswith(".toml") or os.path.sep in name:
    return load_cluster_toml(name)
  mixed = MIXED.fullmatch(name)
  if mixed:
    return mixed_cluster(int(mixed[1]), int(mixed[2] or 4))
  if name not in PRESETS:
    raise ConfigError(f"unknown cluster {name!r}{nearest(name, PRESETS)}; known clusters: "
                      f"{', '.join(sorted(PRESETS))}, mixed<N> or mixed<N>x<G> (N GPUs of 8 types, G per node), "
                      "or a path to a .toml file")
  return PRESETS[name]()
