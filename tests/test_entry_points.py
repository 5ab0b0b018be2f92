"""The console entry points that pyproject.toml installs beside ``python -m`` (hetpipe-train, ...)."""

import json
import os
import subprocess
import sys
import tomllib

import pytest

from helpers import one_minibatch_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
  SCRIPTS = tomllib.load(_f)["project"]["scripts"]
ABSL_SCRIPTS = [name for name, target in SCRIPTS.items() if target.startswith("experiments.")]


def installed(name: str) -> str:
  path = os.path.join(BIN, name)
  if not os.path.exists(path):
    pytest.fail(f"{path} is not installed; run ./setup.sh (it reinstalls when pyproject.toml changes)")
  return path


def test_the_main_commands_have_entry_points():
  assert {"hetpipe-train", "hetpipe-plan", "hetpipe-check", "hetpipe-timeline", "hetpipe-throughput",
          "hetpipe-convergence", "hetpipe-efficiency", "hetpipe-tune"} <= set(SCRIPTS)


def helpshort(name: str) -> str:
  """The script's ``--helpshort`` text (absl prints it and exits with status 1)."""
  proc = subprocess.run([installed(name), "--helpshort"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and not proc.stderr, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.parametrize("name", ABSL_SCRIPTS)
def test_absl_entry_point_prints_its_own_flags(name):
  text = helpshort(name)
  assert f"{name}:" in text and "--out" in text  # --out_dir or --out: every script writes somewhere


def test_train_entry_point_lists_the_cli_contract_flags():
  text = helpshort("hetpipe-train")
  assert text.startswith("Train a model with HetPipe")
  for flag in ("--cuts", "--stages", "--seed", "--executor", "--trace_out", "--metrics_out", "--out_dir"):
    assert flag in text


@pytest.mark.parametrize("name", ["hetpipe-check", "hetpipe-timeline", "hetpipe-efficiency"])
@pytest.mark.slow
def test_trace_tools_report_usage_with_exit_2(name, tmp_path):
  proc = subprocess.run([installed(name)], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.startswith("usage:")
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"ev": "meta"}\nnot json\n')
  for path, message in ((tmp_path / "missing.jsonl", "cannot read trace"), (bad, "line 2 of")):
    proc = subprocess.run([installed(name), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and message in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_check_entry_point_accepts_a_sound_trace(tmp_path):
  events = one_minibatch_trace()
  trace = tmp_path / "t.jsonl"
  trace.write_text("".join(json.dumps(e) + "\n" for e in events))
  proc = subprocess.run([installed("hetpipe-check"), str(trace)], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr
  events[3]["own"] = 1  # the backward claims an update that was never applied
  trace.write_text("".join(json.dumps(e) + "\n" for e in events))
  proc = subprocess.run([installed("hetpipe-check"), str(trace)], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1 and "FAILED" in proc.stdout, proc.stdout + proc.stderr
