"""Emulated heterogeneous clusters and their mapping onto JAX devices.

HetPipe (Park et al., USENIX ATC 2020) trains on GPUs of several generations. Here a cluster is a list of
emulated GPUs, each with a speed (flop/s), a memory size and a node; every emulated GPU is mapped onto one
JAX device (a CPU device under ``--xla_force_host_platform_device_count``, a real GPU elsewhere). The
``virtual`` executor takes task durations from these speeds; the ``wall`` executor can pad each task to
them.

This module holds a small built-in catalogue of four speed classes; the real GPU catalogue (TITAN V, ...)
is the planning issue's.
"""

from __future__ import annotations

import dataclasses
import os
import re

from hetpipe_jax.errors import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuType:
  """A class of emulated GPU.

  Attributes:
    name: short name, e.g. ``"A"``.
    flops: sustained flop/s this class reaches on training kernels.
    memory_bytes: device memory.
  """

  name: str
  flops: float
  memory_bytes: int


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One emulated GPU of a cluster: its type, the node it sits in, its index in the cluster."""

  index: int
  type: GpuType
  node: int

  @property
  def name(self) -> str:
    return f"n{self.node}.{self.type.name}{self.index}"


@dataclasses.dataclass(frozen=True)
class Cluster:
  """An emulated cluster: GPUs grouped in nodes, with one link speed inside a node and one between.

  Attributes:
    name: preset name.
    gpus: the GPUs, grouped by node in order.
    intra_node_bytes_per_s / inter_node_bytes_per_s: link bandwidths for stage-to-stage transfers.
    link_latency_s: a fixed cost per transfer.
  """

  name: str
  gpus: tuple[Gpu, ...]
  intra_node_bytes_per_s: float = 12e9
  inter_node_bytes_per_s: float = 7e9
  link_latency_s: float = 10e-6

  @property
  def num_gpus(self) -> int:
    return len(self.gpus)

  def link_bytes_per_s(self, a: Gpu, b: Gpu) -> float:
    return self.intra_node_bytes_per_s if a.node == b.node else self.inter_node_bytes_per_s

  def transfer_seconds(self, a: Gpu, b: Gpu, num_bytes: int) -> float:
    if a.index == b.index:
      return 0.0
    return self.link_latency_s + num_bytes / self.link_bytes_per_s(a, b)


# Four speed classes, loosely shaped after the paper's testbed (a fast big GPU down to a whimpy small one).
# Figures are emulation parameters, not vendor data.
CLASS_A = GpuType("A", flops=8e12, memory_bytes=24 * GIB)
CLASS_B = GpuType("B", flops=5e12, memory_bytes=12 * GIB)
CLASS_C = GpuType("C", flops=3e12, memory_bytes=8 * GIB)
CLASS_D = GpuType("D", flops=2e12, memory_bytes=6 * GIB)
SPEED_CLASSES = (CLASS_A, CLASS_B, CLASS_C, CLASS_D)


def make_cluster(name: str, types_per_node: list[list[GpuType]], **links) -> Cluster:
  gpus, index = [], 0
  for node, types in enumerate(types_per_node):
    for gpu_type in types:
      gpus.append(Gpu(index=index, type=gpu_type, node=node))
      index += 1
  return Cluster(name=name, gpus=tuple(gpus), **links)


def _hetero4() -> Cluster:
  """4 nodes, one speed class each, 2 GPUs per node: 8 GPUs, 4 speed classes."""
  return make_cluster("hetero4", [[t, t] for t in SPEED_CLASSES])


def _hetero4x4() -> Cluster:
  """4 nodes, one speed class each, 4 GPUs per node: the shape of the paper's 16-GPU testbed."""
  return make_cluster("hetero4x4", [[t] * 4 for t in SPEED_CLASSES])


def _uniform8() -> Cluster:
  """8 GPUs of class A on 2 nodes: a homogeneous control."""
  return make_cluster("uniform8", [[CLASS_A] * 4, [CLASS_A] * 4])


PRESETS = {"hetero4": _hetero4, "hetero4x4": _hetero4x4, "uniform8": _uniform8}


def get_cluster(name: str) -> Cluster:
  """Returns a preset cluster by name.

  Raises:
    ConfigError: for an unknown name, listing the known ones.
  """
  if name not in PRESETS:
    raise ConfigError(f"unknown cluster {name!r}; known clusters: {', '.join(sorted(PRESETS))}")
  return PRESETS[name]()


def assign_gpus(cluster: Cluster, stages_per_vw: list[int]) -> list[list[Gpu]]:
  """Groups the cluster's GPUs into virtual workers, in cluster order (node by node).

  Virtual worker i takes the next ``stages_per_vw[i]`` GPUs. On a preset whose nodes hold one class each,
  this yields virtual workers of different speeds (the paper's NP policy when a virtual worker is a node).

  Raises:
    ConfigError: when the virtual workers need more GPUs than the cluster has.
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


def ensure_cpu_devices(count: int) -> None:
  """Makes JAX expose at least ``count`` CPU devices; call before JAX runs any computation.

  Sets ``jax_num_cpu_devices`` (and XLA_FLAGS for older JAX). Does nothing on an accelerator backend
  beyond raising the CPU device count.

  Raises:
    ConfigError: when JAX has already started with fewer devices.
  """
  import jax  # pylint: disable=g-import-not-at-top

  flags = os.environ.get("XLA_FLAGS", "")
  found = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
  count = max(count, int(found.group(1)) if found else 0)
  if not found:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # JAX already started: fine if it has enough devices.
    have = len(jax.devices())
    if have < count:
      raise ConfigError(
          f"JAX already started with {have} devices and this run needs {count}; set "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts") from None
