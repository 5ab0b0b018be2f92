r"""Behaviour-preservation check: record the traces and metrics of fixed runs, then diff against them.

Every run goes through the training CLI (``experiments.train``) in a subprocess, so the check holds
whatever the code inside looks like. A recorded run is its trace (every event, in order) and its metrics
(JSON Lines), gzipped under ``tests/golden/``. ``--check`` reruns and compares: traces event for event and
field for field, metrics value for value (exactly by default; ``--rtol`` loosens the numbers of the
metrics only, for other machines whose XLA may round differently)::

  python -m experiments.golden --record             # once, before a behaviour-preserving change
  python -m experiments.golden                      # after it: "identical" per run, or the first difference
  python -m experiments.golden --set=small          # the quick set that tests/test_golden.py checks

Sets: ``full`` = the default run, a pinned run with ``--cuts`` and a ``sim`` run with ``--policy=HD`` on
``paper_testbed``; ``small`` = short versions of the same three, plus a wall-free FIFO/latest run.

A recording names the machine it was made on (``tests/golden/<set>.machine.json``: the instruction-set
extensions that XLA's CPU code generation chooses its kernels by). On a machine of the same extensions the
metrics are compared as asked (bit for bit by default); on another, XLA's kernels round differently (a CNN's
first loss differs in its last bits, and the difference grows with training: 4e-5 relative after 16 steps
of the small default run, one test example of 261 classified otherwise), so its numbers are compared at
:data:`CROSS_MACHINE_RTOL` and the check says so. Traces are compared event for event everywhere.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_bool("record", False, "Record the runs (overwrites the golden files) instead of checking.")
flags.DEFINE_enum("set", "full", ["full", "small"], "Which runs: full (the issue's three) or small.")
flags.DEFINE_float("rtol", 0.0, "Relative tolerance for metric numbers (0: bit for bit).")
flags.DEFINE_list("only", [], "Run only these names of the set.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
RUNS = {
    "full": {
        "default": [],
        "cuts": ["--cuts=0,1,5;0,3,5;0,4,5", "--nm=3,2,1", "--d=2", "--waves=60"],
        "sim_hd": ["--executor=sim", "--cluster=paper_testbed", "--policy=HD"],
    },
    "small": {
        "default": ["--dataset=digits", "--waves=8"],
        "cuts": ["--dataset=digits", "--cuts=0,1,5;0,3,5;0,4,5", "--nm=3,2,1", "--d=2", "--waves=6"],
        "fifo_latest": ["--dataset=synthetic", "--model=mlp", "--num_vws=2", "--stages=3,1", "--nm=2,3",
                        "--d=0", "--waves=5", "--schedule=fifo", "--weight_mode=latest",
                        "--optimizer=adam", "--learning_rate=0.003"],
        "sim_hd": ["--executor=sim", "--cluster=paper_testbed", "--policy=HD", "--waves=10"],
    },
}


# The CPU extensions XLA's code generation picks kernels by (vector width, fused multiply-add, 16-bit types).
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_bf16", "amx_tile", "asimd", "sve")
CROSS_MACHINE_RTOL = 1e-2  # metrics recorded on a machine of other extensions (see the module docstring)


def machine() -> dict:
  """This machine as far as XLA's CPU kernels are concerned: its architecture and :data:`ISA_FLAGS`."""
  flags_found: set[str] = set()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          flags_found.update(line.split(":", 1)[1].split())
  except OSError:  # not Linux: the architecture alone
    pass
  return {"arch": platform.machine(), "isa": sorted(flags_found.intersection(ISA_FLAGS))}


def _machine_path(set_name: str) -> str:
  return os.path.join(GOLDEN_DIR, f"{set_name}.machine.json")


def metrics_rtol(set_name: str, rtol: float = 0.0) -> tuple[float, str]:
  """The tolerance for the metrics of ``set_name`` on this machine: ``rtol`` where the recording was made
  on a machine of the same extensions, else at least :data:`CROSS_MACHINE_RTOL`; and why, in words."""
  try:
    with open(_machine_path(set_name), encoding="utf-8") as f:
      recorded = json.load(f)
  except FileNotFoundError:
    recorded = None
  if recorded == machine():
    return rtol, "recorded on a machine of these CPU extensions"
  return max(rtol, CROSS_MACHINE_RTOL), (f"recorded on {recorded or 'an unnamed machine'}, this is {machine()}: "
                                         f"metrics compared at rtol {max(rtol, CROSS_MACHINE_RTOL):g}")


def _read(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def run(args: list[str], out_dir: str) -> tuple[list[dict], list[dict]]:
  """Runs the training CLI with ``args``; returns (trace events, metrics rows)."""
  cmd = [sys.executable, "-m", "experiments.train", f"--out_dir={out_dir}", *args]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                        cwd=ROOT)
  if proc.returncode != 0:
    raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
  return _read(os.path.join(out_dir, "trace.jsonl")), _read(os.path.join(out_dir, "metrics.jsonl"))


def _same(a, b, rtol: float) -> bool:
  if isinstance(a, float) and isinstance(b, float) and rtol > 0:
    return a == b or math.isclose(a, b, rel_tol=rtol) or (math.isnan(a) and math.isnan(b))
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k], rtol) for k in a)
  return a == b


def first_difference(got: list[dict], want: list[dict], rtol: float = 0.0) -> str | None:
  """The first line where two lists of JSON records differ (None when identical)."""
  for n, (g, w) in enumerate(zip(got, want), start=1):
    if not _same(g, w, rtol):
      return f"line {n}: got {json.dumps(g)[:400]}\n    want {json.dumps(w)[:400]}"
  if len(got) != len(want):
    return f"{len(got)} lines, golden has {len(want)}"
  return None


def golden_paths(set_name: str, name: str) -> tuple[str, str]:
  base = os.path.join(GOLDEN_DIR, f"{set_name}_{name}")
  return base + ".trace.jsonl.gz", base + ".metrics.jsonl.gz"


def check_set(set_name: str, rtol: float = 0.0, only=()) -> list[str]:
  """Reruns the set; returns one problem line per run that differs (empty: all identical)."""
  problems = []
  rtol, why = metrics_rtol(set_name, rtol)
  print(f"{set_name}: {why}")
  with tempfile.TemporaryDirectory() as tmp:
    for name, args in RUNS[set_name].items():
      if only and name not in only:
        continue
      trace_path, metrics_path = golden_paths(set_name, name)
      events, metrics = run(args, os.path.join(tmp, name))
      diff = first_difference(events, _read(trace_path))
      if diff is None:
        diff = first_difference(metrics, _read(metrics_path), rtol)
        where = "metrics"
      else:
        where = "trace"
      print(f"{set_name}/{name}: " + ("identical" if diff is None else f"{where} differs at {diff}"))
      if diff is not None:
        problems.append(f"{set_name}/{name}: {where} differs at {diff}")
  return problems


def record_set(set_name: str, only=()) -> None:
  os.makedirs(GOLDEN_DIR, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    for name, args in RUNS[set_name].items():
      if only and name not in only:
        continue
      events, metrics = run(args, os.path.join(tmp, name))
      for path, rows in zip(golden_paths(set_name, name), (events, metrics)):
        with gzip.GzipFile(path, "wb", mtime=0) as f:
          f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode())
        print(f"recorded {path} ({len(rows)} lines)")
  with open(_machine_path(set_name), "w", encoding="utf-8") as f:
    json.dump(machine(), f)
    f.write("\n")


def main(argv):
  del argv
  if FLAGS.record:
    record_set(FLAGS.set, FLAGS.only)
    return 0
  problems = check_set(FLAGS.set, FLAGS.rtol, FLAGS.only)
  print("golden: " + ("every run identical" if not problems else f"{len(problems)} runs differ"))
  return 1 if problems else 0


cli = common.console(main)

if __name__ == "__main__":
  cli()
