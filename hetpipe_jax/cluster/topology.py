"""Clusters of heterogeneous GPUs: a GPU catalogue, links, nodes, presets, TOML files, device mapping.

HetPipe (Park et al., USENIX ATC 2020) trains on GPUs of several generations; its testbed is 4 nodes x 4
GPUs of one type each (TITAN V, TITAN RTX, GeForce RTX 2060, Quadro P4000), PCIe inside a node and 56 Gb/s
InfiniBand between nodes. Here a cluster is a list of GPUs (type + node), an intra-node and an inter-node
link. Every GPU of a run is mapped onto one JAX device (a CPU device under
``--xla_force_host_platform_device_count``, a real GPU elsewhere).

Catalogue figures are the vendors' published peak numbers (sources in BUILD_NOTES.md); the ``efficiency``
of a type is the fraction of its roofline a training kernel reaches (calibrated, see profile.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib

from hetpipe_jax.errors import ConfigError

GIB = 1 << 30
T = 1e12
G = 1e9


def format_bytes(num_bytes: float) -> str:
  """``12.00 GiB``, ``22.9 MiB`` or ``97.7 KiB``: enough digits to tell a need from a capacity."""
  if num_bytes >= GIB:
    return f"{num_bytes / GIB:.2f} GiB"
  if num_bytes >= 1 << 20:
    return f"{num_bytes / (1 << 20):.1f} MiB"
  return f"{num_bytes / 1024:.1f} KiB"


@dataclasses.dataclass(frozen=True)
class GpuType:
  """A GPU model.

  Attributes:
    name: e.g. ``"TITAN V"``.
    memory_bytes: device memory.
    fp32_flops / fp16_flops: peak flop/s (fp16: tensor cores where the GPU has them).
    mem_bytes_per_s: peak memory bandwidth.
    efficiency: fraction of the roofline that training kernels reach.
  """

  name: str
  memory_bytes: int
  fp32_flops: float
  fp16_flops: float
  mem_bytes_per_s: float
  efficiency: float = 0.5

  def peak_flops(self, precision: str = "fp32") -> float:
    return self.fp16_flops if precision == "fp16" else self.fp32_flops


@dataclasses.dataclass(frozen=True)
class Link:
  """A link: bandwidth per direction and a fixed latency per transfer."""

  name: str
  bytes_per_s: float
  latency_s: float

  def seconds(self, num_bytes: float) -> float:
    return self.latency_s + num_bytes / self.bytes_per_s


def _gpu(name, mem_gib, fp32_tflops, fp16_tflops, bw_gbytes, efficiency=0.5):
  return GpuType(name, int(mem_gib * GIB), fp32_tflops * T, fp16_tflops * T, bw_gbytes * G, efficiency)


# Vendor peak figures (boost clocks): memory, FP32, FP16 (tensor cores where present), memory bandwidth.
CATALOGUE = {t.name: t for t in (
    _gpu("TITAN V", 12, 14.9, 110.0, 652.8),
    _gpu("TITAN RTX", 24, 16.3, 130.5, 672.0),
    _gpu("RTX 2060", 6, 6.45, 51.6, 336.0),
    _gpu("Quadro P4000", 8, 5.3, 0.083, 243.3),  # Pascal GP104: FP16 at 1/64 rate, no tensor cores
    _gpu("V100", 32, 15.7, 125.0, 900.0),  # SXM2
    _gpu("A100", 80, 19.5, 312.0, 2039.0),  # SXM4 80 GB
    _gpu("H100", 80, 67.0, 989.4, 3350.0),  # SXM5, dense FP16
    _gpu("RTX 3090", 24, 35.6, 71.0, 936.2),
    _gpu("T4", 16, 8.1, 65.0, 320.0),
    # Emulation classes for small CPU runs: four speeds, not vendor data.
    _gpu("A", 24, 8.0, 16.0, 600.0, 1.0),
    _gpu("B", 12, 5.0, 10.0, 400.0, 1.0),
    _gpu("C", 8, 3.0, 6.0, 300.0, 1.0),
    _gpu("D", 6, 2.0, 4.0, 200.0, 1.0),
)}
CLASS_A, CLASS_B, CLASS_C, CLASS_D = (CATALOGUE[n] for n in "ABCD")
SPEED_CLASSES = (CLASS_A, CLASS_B, CLASS_C, CLASS_D)

LINKS = {l.name: l for l in (
    Link("pcie3", 12e9, 5e-6),  # PCIe 3.0 x16, achievable
    Link("pcie4", 24e9, 5e-6),
    Link("nvlink2", 100e9, 3e-6),
    Link("ib_fdr56", 56e9 / 8, 2e-6),  # InfiniBand FDR 4x: 56 Gb/s
    Link("ib_edr100", 100e9 / 8, 2e-6),
    Link("eth10", 10e9 / 8, 20e-6),
    Link("eth25", 25e9 / 8, 15e-6),
)}


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU of a cluster: its type, its node, its index in the cluster."""

  index: int
  type: GpuType
  node: int

  @property
  def name(self) -> str:
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
    return len(self.gpus)

  @property
  def num_nodes(self) -> int:
    return len({g.node for g in self.gpus})

  def node_gpus(self, node: int) -> list[Gpu]:
    return [g for g in self.gpus if g.node == node]

  def link(self, a: Gpu, b: Gpu) -> Link:
    return self.intra_node if a.node == b.node else self.inter_node

  def transfer_seconds(self, a: Gpu, b: Gpu, num_bytes: float) -> float:
    return 0.0 if a.index == b.index else self.link(a, b).seconds(num_bytes)


def make_cluster(name: str, types_per_node: list[list[GpuType]], intra_node: Link = LINKS["pcie3"],
                 inter_node: Link = LINKS["ib_fdr56"]) -> Cluster:
  """A cluster from the GPU types of each node."""
  gpus, index = [], 0
  for node, types in enumerate(types_per_node):
    for gpu_type in types:
      gpus.append(Gpu(index=index, type=gpu_type, node=node))
      index += 1
  return Cluster(name, tuple(gpus), intra_node, inter_node)


PAPER_TYPES = ("TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000")
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
}


def get_cluster(name: str) -> Cluster:
  """A preset by name, or a cluster from a TOML file (a path ending in .toml).

  Raises:
    ConfigError: for an unknown name, listing the known ones, or a bad file.
  """
  if name.endswith(".toml") or os.path.sep in name:
    return load_cluster_toml(name)
  if name not in PRESETS:
    raise ConfigError(f"unknown cluster {name!r}; known clusters: {', '.join(sorted(PRESETS))}, or a "
                      "path to a .toml file")
  return PRESETS[name]()


def _positive(path: str, where: str, value, unit: str) -> float:
  if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
    raise ConfigError(f"{path}: {where} = {value!r}; it must be a positive number ({unit})")
  return float(value)


def _toml_link(path: str, key: str, value) -> Link:
  if isinstance(value, str):
    if value not in LINKS:
      raise ConfigError(f"{path}: links.{key} = {value!r} is not a known link; use one of "
                        f"{', '.join(LINKS)} or a table {{gbytes_per_s = ..., latency_us = ...}}")
    return LINKS[value]
  if not isinstance(value, dict):
    raise ConfigError(f"{path}: links.{key} must be a link name or a table, not {value!r}")
  return Link(key, _positive(path, f"links.{key}.gbytes_per_s", value.get("gbytes_per_s"), "GB/s") * G,
              _positive(path, f"links.{key}.latency_us", value.get("latency_us", 5), "microseconds") * 1e-6)


def load_cluster_toml(path: str) -> Cluster:
  """Reads a cluster description::

    name = "lab"
    [links]
    intra_node = "pcie3"                 # a known link, or {gbytes_per_s = 12, latency_us = 5}
    inter_node = "ib_fdr56"
    [gpu_types.MyGPU]                    # optional: types beyond the catalogue
    memory_gib = 8
    fp32_tflops = 5.0
    fp16_tflops = 10.0
    bandwidth_gbytes_per_s = 300
    efficiency = 0.5                     # optional
    [[nodes]]
    gpus = ["TITAN V", "TITAN V"]
    [[nodes]]
    gpus = ["MyGPU"]

  Raises:
    ConfigError: naming the file, the key, the bad value and what is expected.
  """
  try:
    with open(path, "rb") as f:
      doc = tomllib.load(f)
  except FileNotFoundError:
    raise ConfigError(f"cluster file {path} does not exist; give a preset name "
                      f"({', '.join(sorted(PRESETS))}) or an existing .toml file") from None
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"cluster file {path} is not valid TOML: {e}") from None
  types = dict(CATALOGUE)
  for name, spec in doc.get("gpu_types", {}).items():
    if not isinstance(spec, dict):
      raise ConfigError(f"{path}: gpu_types.{name} must be a table")
    w = f"gpu_types.{name!r}"
    types[name] = GpuType(
        name, int(_positive(path, f"{w}.memory_gib", spec.get("memory_gib"), "GiB") * GIB),
        _positive(path, f"{w}.fp32_tflops", spec.get("fp32_tflops"), "Tflop/s") * T,
        _positive(path, f"{w}.fp16_tflops", spec.get("fp16_tflops", spec.get("fp32_tflops")), "Tflop/s") * T,
        _positive(path, f"{w}.bandwidth_gbytes_per_s", spec.get("bandwidth_gbytes_per_s"), "GB/s") * G,
        _positive(path, f"{w}.efficiency", spec.get("efficiency", 0.5), "a fraction in (0, 1]"))
    if types[name].efficiency > 1:
      raise ConfigError(f"{path}: {w}.efficiency = {types[name].efficiency}; it must be in (0, 1]")
  nodes = doc.get("nodes")
  if not isinstance(nodes, list) or not nodes:
    raise ConfigError(f"{path}: no [[nodes]]; add at least one [[nodes]] table with gpus = [...]")
  per_node = []
  for n, node in enumerate(nodes):
    gpus = node.get("gpus") if isinstance(node, dict) else None
    if not isinstance(gpus, list) or not gpus:
      raise ConfigError(f"{path}: nodes[{n}].gpus must be a non-empty list of GPU type names")
    for g in gpus:
      if g not in types:
        raise ConfigError(f"{path}: nodes[{n}] has unknown GPU type {g!r}; known: "
                          f"{', '.join(sorted(types))} (or define it under [gpu_types.NAME])")
    per_node.append([types[g] for g in gpus])
  links = doc.get("links", {})
  return make_cluster(str(doc.get("name", os.path.splitext(os.path.basename(path))[0])), per_node,
                      _toml_link(path, "intra_node", links.get("intra_node", "pcie3")),
                      _toml_link(path, "inter_node", links.get("inter_node", "ib_fdr56")))


def assign_gpus(cluster: Cluster, stages_per_vw: list[int]) -> list[list[Gpu]]:
  """Groups the cluster's GPUs into virtual workers, in cluster order (node by node).

  Virtual worker i takes the next ``stages_per_vw[i]`` GPUs. On a preset whose nodes hold one type each
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

  Sets ``jax_num_cpu_devices`` (and XLA_FLAGS for older JAX); never lowers a count already set.

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
