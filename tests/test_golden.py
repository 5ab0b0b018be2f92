"""Behaviour preservation: short runs through the training CLI match their recorded traces and metrics.

The traces (schedule, emulated times, weight versions) must be identical event for event; the metrics
(losses, accuracies) are compared at rtol 1e-6 so that a CPU whose XLA rounds differently does not fail
CI. ``python -m experiments.golden`` checks the full-size runs bit for bit on the development machine.
"""

import pytest

from experiments import golden


@pytest.mark.parametrize("name", list(golden.RUNS["small"]))
def test_small_run_matches_its_recording(name, tmp_path):
  trace_path, metrics_path = golden.golden_paths("small", name)
  events, metrics = golden.run(golden.RUNS["small"][name], str(tmp_path / name))
  assert golden.first_difference(events, golden._read(trace_path)) is None, (
      golden.first_difference(events, golden._read(trace_path)))
  assert golden.first_difference(metrics, golden._read(metrics_path), rtol=1e-6) is None, (
      golden.first_difference(metrics, golden._read(metrics_path), rtol=1e-6))
