"""Multi-process runs as a new user starts them (issue 36): refused before launching, and a node that holds
no stage neither holds the run up nor counts as training. Each run is a subprocess with a timeout."""

import json

import pytest

from hetpipe_jax import read_trace

from helpers import TWO_NODES, assert_trace_ok, train_cli


def test_a_placement_the_executor_does_not_run_is_refused_before_launching(tmp_path):
  out = tmp_path / "out"
  proc = train_cli(out, "--executor=multiprocess", "--placement=striped", "--dataset=synthetic", "--model=mlp",
                   timeout=180)
  assert proc.returncode != 0
  errors = [line for line in proc.stderr.splitlines() if not line.startswith(("I", "W"))]  # (absl's log lines)
  assert errors == ["error: placement=striped is not modelled by the multiprocess executor; use "
                    "placement=default or local"], proc.stderr[-2000:]
  assert "launching" not in proc.stderr and "Traceback" not in proc.stderr
  assert not out.exists()  # nothing started, nothing written


@pytest.mark.slow  # (a 2-process job: 15-60 s on a busy machine)
def test_a_process_with_no_stage_sends_its_part_and_training_time_is_reported(tmp_path):
  """Two nodes, one virtual worker of one stage: process 1 holds no stage (only PS shard copies) and has no
  trace event. Its (empty) part arrives: no 60 s wait for a process taken for gone, and the reported seconds
  end when training did (the clock's last push), before the final gather (the ``applied`` lines)."""
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", f"--cluster={TWO_NODES}",
                   "--num_vws=1", "--stages=1", "--waves=4", timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "no part from processes" not in proc.stderr, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert {e.get("process") for e in events[1:] if e["ev"] in ("fwd", "bwd")} == {0}  # process 1: no stage
  summary = json.loads((tmp_path / "summary.json").read_text())
  last_push = max(e["t"] for e in events if e["ev"] == "push")
  gathered = min(e["t"] for e in events if e["ev"] == "applied")
  assert last_push <= summary["seconds"] <= gathered
