"""A 2-process program for tests/test_distributed.py: process 1 joins and then dies; process 0 waits for a
message from it that never comes (FAIL_MODE=exit: aborts with code 3, as the runtime does on an error;
FAIL_MODE=kill: SIGKILLs itself; FAIL_MODE=hang: stops itself with SIGSTOP, alive but silent)."""

import os
import signal
import sys

from hetpipe_jax.runtime.transport.node import join


def main() -> int:
  node = join(os.environ["COORD"], int(os.environ["NPROC"]), int(os.environ["PID"]), local_devices=1,
              heartbeat_timeout_s=5)
  if node.process == 1:
    if os.environ.get("FAIL_MODE") == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("FAIL_MODE") == "hang":
      os.kill(os.getpid(), signal.SIGSTOP)
    node.abort("a planted failure", 3)
  node.recv(1, "never", timeout_s=120)  # the coordination service aborts this process first
  return 0


if __name__ == "__main__":
  sys.exit(main())
