"""Clusters of heterogeneous GPUs: catalogue, links, nodes, presets, TOML files, device mapping."""

from hetpipe_jax.cluster.topology import *  # noqa: F401,F403  (split into modules below)
