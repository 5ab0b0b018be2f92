"""Clusters from TOML files: any mix of catalogue types, new GPU types, and links.

Every bad value raises one ConfigError that names the file, the key, the value and what is expected; a key
the format does not have (a typo) is refused at every level, naming the nearest valid key.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib

from hetpipe_jax.cluster.catalogue import CATALOGUE, GIB, LINKS, G, GpuType, Link, T
from hetpipe_jax.cluster.topology import PRESETS, Cluster, make_cluster
from hetpipe_jax.errors import ConfigError

# The largest value a key may take, in its unit: far beyond any hardware, and small enough that every
# derived figure (bytes, flop/s, seconds of a task) stays finite.
LIMITS = {"GiB": 1e6, "Tflop/s": 1e6, "GB/s": 1e6, "microseconds": 1e9,
          "a factor in (0, 4]": math.inf}  # efficiency: checked below, with what it means

# The keys of each level of a cluster file.
TOP_KEYS = ("name", "links", "gpu_types", "nodes")
LINKS_KEYS = ("intra_node", "inter_node")
LINK_TABLE_KEYS = ("gbytes_per_s", "latency_us")
GPU_TYPE_KEYS = ("memory_gib", "fp32_tflops", "fp16_tflops", "bandwidth_gbytes_per_s", "efficiency", "bf16")
NODE_KEYS = ("gpus",)


def nearest(name: str, known) -> str:
  """``" (did you mean 'x'?)"`` for the closest of ``known`` to ``name`` (difflib), or ``""`` when none is
  close."""
  close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.5)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(path: str, where: str, table: dict, allowed: tuple[str, ...]) -> None:
  """Refuses a key of ``table`` that is not in ``allowed``, naming the nearest valid one."""
  for key in table:
    if key not in allowed:
      at = f"{where}.{key}" if where else key
      raise ConfigError(f"{path}: unknown key {at!r}{nearest(key, allowed)} (the keys of "
                        f"{where or 'the top level'}: {', '.join(allowed)})")


def _positive(path: str, where: str, value, unit: str) -> float:
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
    raise ConfigError(f"{path}: {where} = {value!r}; it must be a finite positive number ({unit})")
  if value > LIMITS[unit]:
    raise ConfigError(f"{path}: {where} = {value!r} is over the limit of {LIMITS[unit]:g} ({unit}); give the "
                      "value in that unit")
  return float(value)


def _bool(path: str, where: str, value) -> bool:
  if not isinstance(value, bool):
    raise ConfigError(f"{path}: {where} = {value!r}; it must be true or false")
  return value


def _table(path: str, where: str, value, what: str) -> dict:
  if not isinstance(value, dict):
    raise ConfigError(f"{path}: {where} must be {what}, not {value!r}")
  return value


def _toml_link(path: str, key: str, value) -> Link:
  if isinstance(value, str):
    if value not in LINKS:
      raise ConfigError(f"{path}: links.{key} = {value!r} is not a known link{nearest(value, LINKS)}; use one "
                        f"of {', '.join(LINKS)} or a table {{gbytes_per_s = ..., latency_us = ...}}")
    return LINKS[value]
  _check_keys(path, f"links.{key}", _table(path, f"links.{key}", value, "a link name or a table"), LINK_TABLE_KEYS)
  return Link(key, _positive(path, f"links.{key}.gbytes_per_s", value.get("gbytes_per_s"), "GB/s") * G,
              _positive(path, f"links.{key}.latency_us", value.get("latency_us", 5), "microseconds") * 1e-6)


def _gpu_type(path: str, name: str, spec) -> GpuType:
  """One ``[gpu_types.NAME]`` table."""
  w = f"gpu_types.{name!r}"
  _check_keys(path, w, _table(path, w, spec, "a table"), GPU_TYPE_KEYS)
  gpu = GpuType(
      name, int(_positive(path, f"{w}.memory_gib", spec.get("memory_gib"), "GiB") * GIB),
      _positive(path, f"{w}.fp32_tflops", spec.get("fp32_tflops"), "Tflop/s") * T,
      _positive(path, f"{w}.fp16_tflops", spec.get("fp16_tflops", spec.get("fp32_tflops")), "Tflop/s") * T,
      _positive(path, f"{w}.bandwidth_gbytes_per_s", spec.get("bandwidth_gbytes_per_s"), "GB/s") * G,
      _positive(path, f"{w}.efficiency", spec.get("efficiency", 1.0), "a factor in (0, 4]"),
      bf16=_bool(path, f"{w}.bf16", spec.get("bf16", False)))
  if gpu.efficiency > 4:
    raise ConfigError(f"{path}: {w}.efficiency = {gpu.efficiency}; it must be in (0, 4] (the roofline's "
                      "correction factor: measured throughput over the roofline's, about 1)")
  return gpu


def _node(path: str, n: int, node, types: dict[str, GpuType]) -> list[GpuType]:
  """One ``[[nodes]]`` table: its GPUs' types."""
  _check_keys(path, f"nodes[{n}]", _table(path, f"nodes[{n}]", node, "a table with gpus = [...]"), NODE_KEYS)
  gpus = node.get("gpus")
  if not isinstance(gpus, list) or not gpus:
    raise ConfigError(f"{path}: nodes[{n}].gpus must be a non-empty list of GPU type names")
  for g in gpus:
    if g not in types:
      raise ConfigError(f"{path}: nodes[{n}] has unknown GPU type {g!r}{nearest(g, types)}; known: "
                        f"{', '.join(sorted(types))} (or define it under [gpu_types.NAME])")
  return [types[g] for g in gpus]


def _read(path: str) -> dict:
  try:
    with open(path, "rb") as f:
      return tomllib.load(f)
  except FileNotFoundError:
    raise ConfigError(f"cluster file {path} does not exist; give a preset name "
                      f"({', '.join(sorted(PRESETS))}) or an existing .toml file") from None
  except tomllib.TOMLDecodeError as e:
    raise ConfigError(f"cluster file {path} is not valid TOML: {e}") from None


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
    efficiency = 1.0                     # optional: roofline correction factor (catalogue.py)
    bf16 = false                         # optional: bfloat16 at the fp16 rate (else at the fp32 one)
    [[nodes]]
    gpus = ["TITAN V", "TITAN V"]
    [[nodes]]
    gpus = ["MyGPU"]

  Args:
    path: the file.

  Returns:
    The cluster (named by ``name``, or else by the file's base name).

  Raises:
    ConfigError: naming the file, the key, the bad value and what is expected; for a key the format does
      not have, the nearest valid one.
  """
  doc = _read(path)
  _check_keys(path, "", doc, TOP_KEYS)
  gpu_types = _table(path, "gpu_types", doc.get("gpu_types", {}), "a table of [gpu_types.NAME] tables")
  types = dict(CATALOGUE) | {name: _gpu_type(path, name, spec) for name, spec in gpu_types.items()}
  nodes = doc.get("nodes")
  if not isinstance(nodes, list) or not nodes:
    raise ConfigError(f"{path}: no [[nodes]]; add at least one [[nodes]] table with gpus = [...]")
  per_node = [_node(path, n, node, types) for n, node in enumerate(nodes)]
  links = _table(path, "links", doc.get("links", {}), "a table (intra_node = ..., inter_node = ...)")
  _check_keys(path, "links", links, LINKS_KEYS)
  return make_cluster(str(doc.get("name", os.path.splitext(os.path.basename(path))[0])), per_node,
                      _toml_link(path, "intra_node", links.get("intra_node", "pcie3")),
                      _toml_link(path, "inter_node", links.get("inter_node", "ib_fdr56")))
