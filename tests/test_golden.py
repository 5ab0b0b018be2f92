"""Behaviour preservation: short runs through the training CLI match their recorded traces and metrics.

The traces (schedule, emulated times, weight versions) must be identical event for event; the metrics
(losses, accuracies) at rtol 1e-6 on a machine of the recording's CPU extensions, and at
``golden.CROSS_MACHINE_RTOL`` on another, whose XLA kernels round differently (``experiments/golden.py``).
``python -m experiments.golden`` checks the full-size runs.
"""

import pytest

from experiments import golden


@pytest.mark.parametrize("name", list(golden.RUNS["small"]))
@pytest.mark.slow
def test_small_run_matches_its_recording(name, tmp_path):
  trace_path, metrics_path = golden.golden_paths("small", name)
  events, metrics = golden.run(golden.RUNS["small"][name], str(tmp_path / name))
  assert golden.first_difference(events, golden._read(trace_path)) is None, (
      golden.first_difference(events, golden._read(trace_path)))
  rtol, why = golden.metrics_rtol("small", 1e-6)
  diff = golden.first_difference(metrics, golden._read(metrics_path), rtol=rtol)
  assert diff is None, f"{diff} ({why})"


def test_metrics_tolerance_follows_the_recording_machine(monkeypatch, tmp_path):
  """Bit-level tolerance on a machine of the recording's extensions, the cross-machine one on another, and
  on any when the recording names no machine."""
  here = golden.machine()
  assert here["isa"] == sorted(set(here["isa"])) and set(here["isa"]) <= set(golden.ISA_FLAGS)
  monkeypatch.setattr(golden, "GOLDEN_DIR", str(tmp_path))
  monkeypatch.setattr(golden, "machine", lambda: {"arch": "x86_64", "isa": ["avx", "avx2", "fma"]})
  assert golden.metrics_rtol("small", 1e-6)[0] == golden.CROSS_MACHINE_RTOL  # no stamp
  (tmp_path / "small.machine.json").write_text('{"arch": "x86_64", "isa": ["avx", "avx2", "fma"]}')
  assert golden.metrics_rtol("small", 1e-6)[0] == 1e-6
  monkeypatch.setattr(golden, "machine", lambda: {"arch": "x86_64", "isa": ["avx", "avx2", "avx512f", "fma"]})
  rtol, why = golden.metrics_rtol("small", 1e-6)
  assert rtol == golden.CROSS_MACHINE_RTOL and "avx512f" in why
