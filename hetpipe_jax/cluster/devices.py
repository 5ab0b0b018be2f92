"""JAX devices for an emulated cluster: every GPU of a run is one JAX device (a CPU device on a host).

On a CPU host JAX exposes ``--xla_force_host_platform_device_count`` devices; a run of N GPUs needs at
least N of them, fixed before JAX starts.
"""

from __future__ import annotations

import os
import re

from hetpipe_jax.errors import ConfigError


def ensure_cpu_devices(count: int) -> None:
  """Makes JAX expose at least ``count`` CPU devices; call before JAX runs any computation.

  Sets ``jax_num_cpu_devices`` (and XLA_FLAGS for older JAX); never lowers a count already set.

  Args:
    count: the number of devices the run needs.

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
