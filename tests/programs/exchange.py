"""A 2-process program for tests/test_distributed.py: arrays both ways through hetpipe_jax's Node.

Process 0 sends an activation-like array and a small int array to process 1 on channel "act"; process 1
checks them and returns the first doubled on channel "grad"; process 0 checks that. Then direct messages
(no notice): process 1 pulls "d0" before process 0 offers it (half a second later), then five more on one
stream that holds five, in order (the sender's hold stays at five once process 1 has pulled them all and a
seventh goes); a direct message not offered in time times out (it is offered afterwards, so that no pull is
left waiting at exit). Each prints "ok".
Environment: COORD (host:port), NPROC, PID.
"""

import os
import sys
import time

from hetpipe_jax.runtime.transport.node import join


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
  spec = [((1000,), "float32")]
  if node.process == 0:
    time.sleep(0.5)  # process 1 is already pulling
    for k in range(6):
      node.send_direct(1, f"d{k}", [jnp.full((1000,), float(k))], stream="s", hold=5)
    node.barrier("direct-pulled", 60)
    node.send_direct(1, "d6", [jnp.full((1000,), 6.0)], stream="s", hold=5)
    held = node._direct[(1, "s")]  # pylint: disable=protected-access
    ok = ok and [float(a[0]) for (a,) in held] == [2.0, 3.0, 4.0, 5.0, 6.0]  # the newest five
    node.barrier("timed-out", 60)
    node.send_direct(1, "late", [jnp.zeros((1000,))], stream="late", hold=1)
    node.barrier("direct-done", 60)
  else:
    t = time.monotonic()
    (d0,) = node.recv_direct(0, "d0", spec, timeout_s=60)
    ok = ok and float(d0[0]) == 0.0 and time.monotonic() - t > 0.3  # (it waited for the offer)
    got = [float(node.recv_direct(0, f"d{k}", spec, timeout_s=60)[0][-1]) for k in range(1, 6)]
    ok = ok and got == [1.0, 2.0, 3.0, 4.0, 5.0]
    node.barrier("direct-pulled", 60)
    ok = ok and float(node.recv_direct(0, "d6", spec, timeout_s=60)[0][0]) == 6.0
    try:
      node.recv_direct(0, "late", spec, timeout_s=1.0)
      ok = False
    except TimeoutError as e:
      ok = ok and "no late from process 0 within 1 s" in str(e)
    node.barrier("timed-out", 60)
    node.barrier("direct-done", 60)
    time.sleep(0.5)  # the given-up pull lands
  node.close()
  print("ok" if ok else "WRONG", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
