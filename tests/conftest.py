"""Test setup: 8 CPU devices before JAX starts, and a profile cache and compiled-program cache of the
session's own.

The profile cache (``$HETPIPE_JAX_CACHE``, read by every profile call) and JAX's persistent compilation
cache (``$HETPIPE_JAX_XLA_CACHE``) point into a temporary directory made for this session and removed
after it, so tests never read or write the user's ``~/.cache/hetpipe_jax``; the subprocesses tests start
inherit them with the environment.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HETPIPE_JAX_CACHE"] = tempfile.mkdtemp(prefix="hetpipe_jax_test_cache-")
atexit.register(shutil.rmtree, os.environ["HETPIPE_JAX_CACHE"], ignore_errors=True)
os.environ["HETPIPE_JAX_XLA_CACHE"] = os.path.join(os.environ["HETPIPE_JAX_CACHE"], "xla")

import jax  # noqa: E402  (after the environment it reads)

jax.config.update("jax_num_cpu_devices", 8)

from hetpipe_jax.cluster import enable_compilation_cache  # noqa: E402

enable_compilation_cache()
