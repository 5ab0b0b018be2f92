"""The multi-process transport on loopback: processes meet through jax.distributed and move arrays.

Every multi-process test runs its processes as subprocesses with a timeout and kills what it started.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.runtime.transport.launch import check_port_free, free_port, launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_job(program: str, num_processes: int, timeout_s: float, grace_s: float = 60.0, survivable: bool = False,
            **extra_env):
  """Runs ``tests/programs/<program>`` as one job of ``num_processes`` processes on loopback.

  Returns the launcher's JobResult and every process's (stdout, stderr).
  """
  coord = f"127.0.0.1:{free_port()}"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  envs = [{**env, **extra_env, "COORD": coord, "NPROC": str(num_processes), "PID": str(i)}
          for i in range(num_processes)]
  with tempfile.TemporaryDirectory() as tmp:
    files = [[open(os.path.join(tmp, f"{i}.{kind}"), "w+") for kind in ("out", "err")]  # noqa: SIM115
             for i in range(num_processes)]
    try:
      result = launch([[sys.executable, os.path.join(HERE, "programs", program)]] * num_processes, envs,
                      timeout_s, grace_s, names=[f"node {i}" for i in range(num_processes)], survivable=survivable,
                      output=lambda i: (files[i][0].fileno(), files[i][1].fileno()))
      outputs = []
      for pair in files:
        for f in pair:
          f.seek(0)
        outputs.append(tuple(f.read() for f in pair))
    finally:
      for pair in files:
        for f in pair:
          f.close()
  return result, outputs


@pytest.mark.slow  # 10-16 s: the fast suite keeps under 10 minutes
def test_two_processes_exchange_arrays_both_ways():
  result, outputs = run_job("exchange.py", 2, timeout_s=180)
  assert result.ok, (result.message, outputs)
  assert all(out.strip().endswith("ok") for out, _ in outputs), outputs


@pytest.mark.parametrize("mode", ["exit", "kill"])
@pytest.mark.slow
def test_a_lost_process_ends_the_job_in_bounded_time(mode):
  result, outputs = run_job("fail.py", 2, timeout_s=150, grace_s=30, FAIL_MODE=mode)
  assert not result.ok and result.failed == 1, (result.message, outputs)
  how = "exited with code 3 (a planted failure)" if mode == "exit" else "was killed by signal 9"
  assert result.message.startswith(f"node 1 (process 1) {how}; the job stopped"), result.message
  assert result.returncodes[0] not in (None, 0)  # the survivor stopped too (aborted or killed)
  assert result.seconds < 60, result.seconds  # well before its own 120 s wait


@pytest.mark.slow
def test_a_hung_process_is_named_and_the_job_ends_in_bounded_time():
  """Process 1 stops (SIGSTOP: alive, silent): the service ends process 0, the launcher names and kills 1."""
  result, outputs = run_job("fail.py", 2, timeout_s=150, grace_s=60, FAIL_MODE="hang")
  assert not result.ok and result.failed == 1, (result.message, outputs)
  assert result.message.startswith("node 1 (process 1) hung: it stopped answering"), result.message
  assert result.returncodes == [-signal.SIGABRT, -signal.SIGKILL], result.returncodes
  assert result.seconds < 60, result.seconds  # heartbeat timeout (5 s) + settle (5 s), not the grace


@pytest.mark.parametrize("mode", ["kill", pytest.param("hang", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_recoverable_job_goes_on_without_a_lost_process(mode):
  """Process 2 is lost (killed, or stopped: alive but silent); process 0 declares it gone within ~5 s,
  process 1's wait for it gives up, both end cleanly; the launcher lists what the job went on without."""
  result, outputs = run_job("survive.py", 3, timeout_s=150, survivable=True, SURVIVE_MODE=mode)
  assert result.ok and result.returncodes[:2] == [0, 0], (result.message, outputs)
  assert outputs[0][0].strip().endswith("ok dead=[2]"), outputs[0]
  assert "ok gave up: process 2 is gone" in outputs[1][0], outputs[1]
  how = "was killed by signal 9" if mode == "kill" else "hung (killed)"
  assert result.lost == [f"node 2 (process 2) {how}"], result.lost
  assert result.seconds < 60, result.seconds


def test_a_coordinator_port_in_use_is_one_clear_error():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"coordinator port {port} on 127.0.0.1 is in use"):
      check_port_free(f"127.0.0.1:{port}")
  check_port_free(f"127.0.0.1:{free_port()}")


def test_a_process_id_out_of_range_is_one_clear_error():
  proc = subprocess.run([sys.executable, "-c", "from hetpipe_jax.runtime.transport.node import join; "
                         "join('127.0.0.1:1', 2, 5, 1)"], capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode != 0 and "process_id=5 is outside 0..1" in proc.stderr
