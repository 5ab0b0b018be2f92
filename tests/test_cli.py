"""The training CLI end to end, in its own process (it sets up its own CPU devices)."""

import json
import os
import subprocess
import sys

import pytest

from hetpipe_jax import read_trace

from helpers import assert_trace_ok


@pytest.mark.parametrize("executor", ["virtual", "wall"])
def test_train_cli_writes_outputs_the_checker_accepts(tmp_path, executor):
  trace = tmp_path / "t.jsonl"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--num_vws=3", "--stages=2", "--nm=3", "--d=1",
       "--waves=6", f"--executor={executor}", f"--trace_out={trace}", f"--out_dir={tmp_path}",
       "--eval_every=3"],
      capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "trace check: OK" in proc.stdout
  events = read_trace(str(trace))
  assert events[0]["executor"] == executor and events[0]["num_vws"] == 3
  assert_trace_ok(events)
  check = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(trace)], capture_output=True,
                         text=True, timeout=120)
  assert check.returncode == 0 and "OK" in check.stdout
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 3 * 6
  assert all({"vw", "wave", "step", "time", "train_loss"} <= set(r) for r in rows)
  assert sum("test_accuracy" in r for r in rows) >= 2
  assert (tmp_path / "training.png").stat().st_size > 10_000
  assert (tmp_path / "timeline.png").stat().st_size > 10_000
  assert json.loads((tmp_path / "timeline.chrome.json").read_text())["traceEvents"]
  for name in ("metrics.jsonl", "summary.json", "training.png", "timeline.png", "timeline.chrome.json"):
    assert str(tmp_path / name) in proc.stdout
