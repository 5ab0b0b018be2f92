"""A 3-process program for tests/test_distributed.py: a recoverable job in which process 2 is lost
(SURVIVE_MODE=kill: SIGKILLs itself; hang: SIGSTOPs itself, alive but silent) while process 1 waits for a
message from it; process 0 watches. Process 1's wait gives up (PeerGone) once process 0 declares 2 gone,
and processes 0 and 1 end cleanly. Each survivor prints "ok" with what it saw."""

import os
import signal
import sys
import time

from hetpipe_jax.runtime.transport.node import PeerGone, join


def main() -> int:
  node = join(os.environ["COORD"], int(os.environ["NPROC"]), int(os.environ["PID"]), local_devices=1,
              recoverable=True)
  if node.process == 2:
    os.kill(os.getpid(), signal.SIGKILL if os.environ["SURVIVE_MODE"] == "kill" else signal.SIGSTOP)
  seen = "?"
  if node.process == 0:
    node.watch(lambda p: None)
    t0 = time.monotonic()
    while 2 not in node.dead and time.monotonic() - t0 < 60:
      time.sleep(0.1)
    seen = f"dead={sorted(node.dead)}"
  else:
    try:
      node.recv(2, "never", timeout_s=60)
    except PeerGone as e:
      seen = f"gave up: {e}"
  node.close()
  print(f"ok {seen}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
