"""Test setup: 8 CPU devices before JAX starts; shared helpers for building and checking runs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_num_cpu_devices", 8)
