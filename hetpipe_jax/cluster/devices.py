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


XLA_CACHE_ENV = "HETPIPE_JAX_XLA_CACHE"  # names the compiled-program cache directory; empty turns it off
XLA_CACHE_DIR = "~/.cache/hetpipe_jax/xla"


def enable_compilation_cache() -> str | None:
  """Keeps every program XLA compiles in JAX's persistent compilation cache, so that a run whose stage
  programs an earlier run (of this process or another) already compiled loads them instead: the same
  programs, so the same results. The directory is ``$HETPIPE_JAX_XLA_CACHE`` if set (empty: no cache),
  else ``~/.cache/hetpipe_jax/xla``. It is not capped (JAX's cap needs the ``filelock`` package); a program
  takes about 13 KB, and the directory may be deleted at any time.

  Returns:
    The cache directory, or None when the cache is off.
  """
  import jax  # pylint: disable=g-import-not-at-top

  path = os.environ.get(XLA_CACHE_ENV, XLA_CACHE_DIR)
  if not path:
    return None
  path = os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path
