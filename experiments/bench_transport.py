r"""How fast the multi-process transport moves arrays between two processes on loopback.

Two processes of one job (``hetpipe_jax.runtime.launch``, ``hetpipe_jax.runtime.distributed``): for each
size (1, 10, 100 MB of float32) process 0 sends ``--reps`` messages to process 1 (a push: a worker's
update to a shard owner) and process 1 sends as many back (a pull: weights to a worker), each message an
offer on the transfer server plus a notice in the coordination service's key-value store, as the runtime
uses them. The receiver times ``recv`` (notice wait + pull + ready). The baseline is a local
``jax.device_put`` between two CPU devices of one process. CPU emulation on loopback, not a network.
Last line ``transport_gbytes_per_s=<100 MB, both directions> ratio_to_local_copy=<x>``::

  python -m experiments.bench_transport
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 5, "Messages per size and direction (after one untimed warm-up message).")
flags.DEFINE_list("mbytes", ["1", "10", "100"], "Message sizes in MB (float32 arrays).")
flags.DEFINE_float("timeout", 300, "Seconds before the job is killed.")

WORKER_ENV = "HETPIPE_BENCH_TRANSPORT_OUT"  # set in the two processes: where each writes its timings (+ .<process>)


def _timed_recv(node, src: int, tag: str) -> float:
  import jax
  t = time.perf_counter()
  arrays = node.recv(src, tag, timeout_s=120)
  jax.block_until_ready(arrays)
  return time.perf_counter() - t


def worker() -> int:
  """One process of the job: process 0 pushes then serves pulls, process 1 receives then pulls."""
  from hetpipe_jax.runtime.distributed import join
  node = join(os.environ["COORD"], 2, int(os.environ["PID"]), local_devices=2)
  import jax
  import jax.numpy as jnp

  sizes = [int(m) for m in os.environ["SIZES"].split(",")]
  reps = int(os.environ["REPS"])
  timings: dict[str, list[float]] = {}
  for mb in sizes:
    x = jnp.ones((mb * (1 << 20) // 4,), jnp.float32) * (1 + node.process)
    jax.block_until_ready(x)
    for direction, (src, dst) in (("push", (0, 1)), ("pull", (1, 0))):
      tag = f"{direction}{mb}"
      for r in range(reps + 1):
        if node.process == src:
          node.send(dst, tag, [x + r])
          node.get(f"bench/{tag}/{r}", 120)  # the receiver has it: the next message starts cold
        else:
          seconds = _timed_recv(node, src, tag)
          node.put(f"bench/{tag}/{r}", "1")
          if r:  # the first message opens the connection: untimed
            timings.setdefault(f"{direction}:{mb}", []).append(seconds)
  devices = jax.local_devices()
  for mb in sizes:
    x = jax.device_put(jnp.ones((mb * (1 << 20) // 4,), jnp.float32), devices[0])
    jax.block_until_ready(jax.device_put(x, devices[1]))
    local = []
    for r in range(reps):
      y = jax.block_until_ready(x + r)  # a fresh array each time, made before the clock starts
      t = time.perf_counter()
      jax.block_until_ready(jax.device_put(y, devices[1]))
      local.append(time.perf_counter() - t)
    timings[f"local:{mb}"] = local
  with open(f"{os.environ[WORKER_ENV]}.{node.process}", "w", encoding="utf-8") as f:
    json.dump(timings, f)
  node.close()
  return 0


def main(argv):
  del argv
  from hetpipe_jax.runtime.launch import child_environment, free_port, launch
  sizes = common.parse_ints("mbytes", FLAGS.mbytes)
  env = child_environment()
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "timings.json")
    job_env = {**env, "COORD": f"127.0.0.1:{free_port()}", "SIZES": ",".join(map(str, sizes)),
               "REPS": str(FLAGS.reps), WORKER_ENV: out}
    cmd = [sys.executable, "-m", "experiments.bench_transport", "--worker"]
    result = launch([cmd, cmd], [{**job_env, "PID": "0"}, {**job_env, "PID": "1"}], FLAGS.timeout, grace_s=30)
    if not result.ok:
      raise SystemExit(f"error: the benchmark job failed: {result.message}")
    timings = {}
    for process in (1, 0):  # each receiver timed its own direction; the local copy: process 1's
      with open(f"{out}.{process}", encoding="utf-8") as f:
        timings = {**json.load(f), **timings}
  print(f"{'MB':>5} {'push GB/s':>10} {'pull GB/s':>10} {'local copy GB/s':>16} {'transport / local':>18}")
  rate = lambda key, mb: mb * (1 << 20) / statistics.median(timings[f"{key}:{mb}"]) / 1e9
  for mb in sizes:
    push, pull, local = rate("push", mb), rate("pull", mb), rate("local", mb)
    print(f"{mb:>5} {push:10.2f} {pull:10.2f} {local:16.2f} {(push + pull) / 2 / local:18.2f}")
  big = max(sizes)
  transport = (rate("push", big) + rate("pull", big)) / 2
  print("two CPU processes on loopback (CPU emulation), median of --reps messages per size and direction; "
        "a message = offer on the transfer server + notice in the key-value store + pull")
  print(f"transport_gbytes_per_s={transport:.3f} ratio_to_local_copy={transport / rate('local', big):.3f}")


if __name__ == "__main__":
  if "--worker" in sys.argv:
    sys.exit(worker())
  common.console(main)()
