"""A 2-process program for tests/test_distributed.py: arrays both ways through hetpipe_jax's Node.

Process 0 sends an activation-like array and a small int array to process 1 on channel "act"; process 1
checks them and returns the first doubled on channel "grad"; process 0 checks that. Each prints "ok".
Environment: COORD (host:port), NPROC, PID.
"""

import os
import sys

from hetpipe_jax.runtime.distributed import join


def main() -> int:
  node = join(os.environ["COORD"], int(os.environ["NPROC"]), int(os.environ["PID"]), local_devices=2)
  import jax.numpy as jnp  # after join: the first JAX use waits for every process

  if node.process == 0:
    x = jnp.arange(250_000, dtype=jnp.float32)  # 1 MB
    node.send(1, "act", [x, jnp.array([3, 4], jnp.int32)])
    (g,) = node.recv(1, "grad", timeout_s=60)
    ok = bool((g == 2 * x).all()) and g.devices() == {node.device}
  else:
    x, small = node.recv(0, "act", timeout_s=60)
    ok = x.shape == (250_000,) and small.tolist() == [3, 4] and float(x[-1]) == 249_999.0
    node.send(0, "grad", [2 * x])
  node.close()
  print("ok" if ok else "WRONG", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
