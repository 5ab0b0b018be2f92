"""Clusters of heterogeneous GPUs: the catalogue and links, nodes and presets, TOML files, devices.

``catalogue`` (GPU types, links), ``topology`` (GPUs, clusters, presets, grouping), ``toml`` (cluster
files), ``lookup`` (a cluster by name: preset, ``mixed<N>`` or file), ``devices`` (JAX devices for an
emulated cluster).
"""

from hetpipe_jax.cluster.catalogue import (
    CATALOGUE,
    CLASS_A,
    CLASS_B,
    CLASS_C,
    CLASS_D,
    GIB,
    LINKS,
    PAPER_TYPES,
    SCALE_TYPES,
    SPEED_CLASSES,
    GpuType,
    Link,
    format_bytes,
)
from hetpipe_jax.cluster.devices import enable_compilation_cache, ensure_cpu_devices
from hetpipe_jax.cluster.lookup import get_cluster
from hetpipe_jax.cluster.toml import load_cluster_toml
from hetpipe_jax.cluster.topology import (
    PRESETS,
    Cluster,
    Gpu,
    assign_gpus,
    make_cluster,
    mixed_cluster,
)

__all__ = [
    "CATALOGUE", "CLASS_A", "CLASS_B", "CLASS_C", "CLASS_D", "GIB", "LINKS", "PAPER_TYPES", "PRESETS",
    "SCALE_TYPES", "SPEED_CLASSES", "Cluster", "Gpu", "GpuType", "Link", "assign_gpus", "enable_compilation_cache",
    "ensure_cpu_devices", "format_bytes", "get_cluster", "load_cluster_toml", "make_cluster",
    "mixed_cluster",
]
