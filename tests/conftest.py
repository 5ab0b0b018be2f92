"""Test setup: 8 CPU devices before JAX starts, and a profile cache and compiled-program cache of the
session's own. With ``HETPIPE_ORACLE=1`` every trace any test checks in this process is also checked by the
checker without its shortcuts (``test_checker_oracle.oracle``), and the two lists of violations must agree.

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

if os.environ.get("HETPIPE_ORACLE"):
  import pytest  # noqa: E402

  from hetpipe_jax.core import check  # noqa: E402

  @pytest.fixture(autouse=True)
  def _the_oracle_beside_every_check(monkeypatch):
    """Every :class:`check.StreamCheck` (what every check runs on) keeps its events and, at its end, asks the oracle."""
    from test_checker_oracle import oracle

    seen, first_call, first_finish = {}, check.StreamCheck.__call__, check.StreamCheck.finish

    def call(self, event):
      seen.setdefault(id(self), (self, []))[1].append(event)
      first_call(self, event)

    def finish(self):
      found = first_finish(self)
      events = seen.pop(id(self), (self, []))[1]
      try:
        in_version_1 = list(check.as_version_1(events))
      except check.ConfigError:
        return found  # (a seq not reached yet: no version 1 to compare with)
      assert found == oracle(in_version_1), "the checker and its oracle disagree"
      return found

    monkeypatch.setattr(check.StreamCheck, "__call__", call)
    monkeypatch.setattr(check.StreamCheck, "finish", finish)
