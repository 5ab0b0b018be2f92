"""Benchmark setup: 8 CPU devices before JAX starts, which tree's package is timed, and the ``timed`` fixture.

``timed(build, *args, rounds=R)`` builds a :class:`workloads.Workload` (not timed; a tree without its API
skips the benchmark with the reason), times ``R`` rounds of its ``run`` with pytest-benchmark (a fresh
``setup()`` before each, not timed, after one warm-up round), then checks the last round's result.

JAX's persistent compilation cache (in ``$HETPIPE_BENCH_XLA_CACHE``, else a temporary directory) makes
the wall benchmark's fresh run in each round's setup compile once per process (or once per comparison),
not once per round; the programs it loads are the ones a compilation would make.

``benchmarks/compare.py`` sets ``HETPIPE_BENCH_TREE`` (the tree whose package must be imported: the
editable install's import hook is dropped, so a module that tree lacks is missing rather than taken from
the working tree, and a benchmark that imports from elsewhere fails) and ``HETPIPE_BENCH_SKIPS`` (a file
that collects the reasons of skips and failures, to print beside the ratios).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile

import pytest

TREE = os.environ.get("HETPIPE_BENCH_TREE")
if TREE:  # TREE's package only: the editable install's finder would lend it the working tree's missing modules
  sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]

import workloads  # noqa: E402  (after the finders it imports through)

workloads.ensure_devices(8)
if os.environ.get("HETPIPE_BENCH_XLA_CACHE"):
  workloads.compilation_cache(os.environ["HETPIPE_BENCH_XLA_CACHE"])
else:
  workloads.compilation_cache(tempfile.mkdtemp(prefix="hetpipe-bench-xla-"))
  atexit.register(shutil.rmtree, workloads.compilation_cache_dir(), ignore_errors=True)
HERE = os.path.dirname(os.path.abspath(__file__))


def foreign_modules() -> list[str]:
  """The modules of the package loaded from outside ``$HETPIPE_BENCH_TREE`` (none when it is unset)."""
  if not TREE:
    return []
  tree = os.path.realpath(TREE)
  return [f"{name} ({m.__file__})" for name, m in list(sys.modules.items())
          if name.split(".")[0] == "hetpipe_jax" and getattr(m, "__file__", None)
          and os.path.commonpath([os.path.realpath(m.__file__), tree]) != tree]


if foreign_modules():
  raise pytest.UsageError(f"HETPIPE_BENCH_TREE={TREE} but {foreign_modules()[0]} is imported; put the tree first on "
                          "PYTHONPATH and run python with -P")


def pytest_report_header(config):
  del config
  return f"hetpipe_jax from {workloads.package_dir()}"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  """``--benchmark-save`` results go to benchmarks/.results (git-ignored), not ./.benchmarks."""
  if config.getoption("benchmark_storage", None) == "file://./.benchmarks":
    config.option.benchmark_storage = "file://" + os.path.join(HERE, ".results")


def pytest_runtest_logreport(report):
  """Appends each skip's and failure's reason to ``$HETPIPE_BENCH_SKIPS`` (for compare.py)."""
  path = os.environ.get("HETPIPE_BENCH_SKIPS")
  if not path or not (report.skipped or report.failed):
    return
  if report.skipped and isinstance(report.longrepr, tuple):
    reason = report.longrepr[2].removeprefix("Skipped: ")
  else:
    reason = (str(report.longrepr).strip().splitlines() or ["?"])[-1]
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"name": report.nodeid.split("::")[-1], "reason": reason,
                        "outcome": "skipped" if report.skipped else "failed"}) + "\n")


@pytest.fixture
def timed(benchmark):
  """``timed(build, *args, rounds=R)``: see the module docstring."""

  def go(build, *args, rounds: int):
    try:
      workload = build(*args)
    except workloads.Unavailable as e:
      pytest.skip(str(e))
    assert not foreign_modules(), f"modules from outside {TREE}: {foreign_modules()}"
    last = {}

    def setup():
      last["args"] = workload.setup()
      return last["args"], {}

    benchmark.extra_info.update(workload.info)
    benchmark.pedantic(workload.run, setup=setup, rounds=rounds, warmup_rounds=1)
    if workload.check is not None:
      benchmark.extra_info.update(workload.check(*last["args"]) or {})

  return go
