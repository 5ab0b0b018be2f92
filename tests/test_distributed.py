"""The multi-process transport on loopback: processes meet through jax.distributed and move arrays.

Every multi-process test runs its processes as subprocesses with a timeout and kills what it started.
"""

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(program: str, num_processes: int, timeout_s: float) -> list[subprocess.CompletedProcess]:
  """Runs ``program`` as ``num_processes`` processes of one job; kills them all after ``timeout_s``."""
  coord = f"127.0.0.1:{free_port()}"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "programs", program)], cwd=ROOT,
                            env={**env, "COORD": coord, "NPROC": str(num_processes), "PID": str(i)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(num_processes)]
  deadline = time.monotonic() + timeout_s
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return results


def test_two_processes_exchange_arrays_both_ways():
  try:
    results = launch("exchange.py", 2, timeout_s=180)
  except subprocess.TimeoutExpired:
    pytest.fail("the 2-process exchange hung (killed after 180 s)")
  for i, r in enumerate(results):
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"process {i}:\n{r.stdout}\n{r.stderr[-3000:]}"


def test_a_process_id_out_of_range_is_one_clear_error():
  proc = subprocess.run([sys.executable, "-c", "from hetpipe_jax.runtime.distributed import join; "
                         "join('127.0.0.1:1', 2, 5, 1)"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode != 0 and "process_id=5 is outside 0..1" in proc.stderr
