r"""The multi-process runtime's costs on this machine, measured in one run (CPU emulation, loopback).

1. **Transport**: push/pull GB/s for 1, 10 and 100 MB of float32 between two processes of one job
   (``hetpipe_jax.runtime.transport.launch`` + ``hetpipe_jax.runtime.transport.node``): process 0 sends ``--reps``
   messages to process 1 (a push: a stage's update to a shard owner) and process 1 sends as many back (a
   pull: weights to a stage), each an offer on the transfer server plus a notice in the coordination
   service's key-value store, as the runtime uses them; the receiver times ``recv`` (notice wait + pull +
   ready). Against a local ``jax.device_put`` between two CPU devices of one process.
2. **Per-task overhead**: one virtual worker of 2 stages on 2 nodes (Nm = 2, D = 0 or ``--d``, small MLP, no
   padding; ``--processes=2,4,8``: also 4 stages on 4 nodes, and 2 virtual workers of 4 on 8) as a
   ``multiprocess`` job (decentralised: each process runs its stages by the schedule; every activation,
   gradient, push, pull and control message goes through the transport, no key-value operation while it
   trains; with D = 0 every wave waits for its push and pull to go through the clock and the owners)
   against the same layout on the single-process ``wall`` executor, whose pushes and pulls are in-process:
   seconds per task of each, and their ratio.
3. **PS apply rate**: a push of 400 MB of weights (4 units of 100 MB, ``optax.identity``) to
   :class:`~hetpipe_jax.runtime.numerics.ps.ParameterServer`, as bytes read and written per second (weights and
   update read, weights written), against a donated jitted add of the same arrays; a jitted add without
   donation (how the server applied before) for comparison. The apply as the multi-process runtime's shards
   do it (the stages checked the update for NaN and Inf: one pass; ``ps_apply_ratio``), as one process's
   server does it (the check fused in: a second read of the update), and the stages' check on its own.

The last line is machine-readable::

  transport_gbytes_per_s=<100 MB, both directions> overhead_ratio=<multiprocess / wall seconds per task>
  ps_apply_ratio=<apply GB/s / donated add GB/s> [overhead_ratios=<processes>:<ratio>,...]

  python -m experiments.bench_multiprocess
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import flags

from experiments import common
from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.runtime.numerics.ps import ParameterServer, nonfinite_units
from hetpipe_jax.runtime.transport.launch import child_environment, free_port, launch
from hetpipe_jax.runtime.transport.node import join

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 5, "Messages per size and direction (after one untimed warm-up message).")
flags.DEFINE_list("mbytes", ["1", "10", "100"], "Message sizes in MB (float32 arrays).")
flags.DEFINE_float("timeout", 300, "Seconds before a job is killed.")
flags.DEFINE_integer("waves", 150, "Waves of the per-task overhead runs.")
flags.DEFINE_list("processes", ["2"], "Nodes (processes) of the per-task overhead runs, one run each: 2-4 make one "
                  "virtual worker across them, multiples of 4 virtual workers of 4 stages.")
flags.DEFINE_integer("d", 0, "Clock distance D of the per-task overhead runs (0: every wave waits for its own push and "
                     "pull; >= 1: WSP lets the next wave start on local weights while they travel).")
flags.DEFINE_integer("ps_mbytes", 400, "Weights pushed to the parameter server, in MB (4 equal units).")

WORKER_ENV = "HETPIPE_BENCH_MULTIPROCESS_OUT"  # set in the two processes: where each writes its timings (+ .<process>)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """The benchmark's settings (its flags): messages per size, sizes in MB, job timeout, waves, processes and D
  of the per-task runs, and the MB pushed to the parameter server."""

  reps: int
  mbytes: tuple[int, ...]
  timeout: float
  waves: int
  processes: tuple[int, ...]
  d: int
  ps_mbytes: int


def config_from_flags() -> BenchConfig:
  """The benchmark's settings from its flags."""
  if not FLAGS.processes or not FLAGS.mbytes:
    raise common.config_error(f"--processes={','.join(FLAGS.processes)} --mbytes={','.join(FLAGS.mbytes)}: give "
                              "at least one value each, e.g. --processes=2 --mbytes=1,10,100")
  return BenchConfig(FLAGS.reps, tuple(common.parse_ints("mbytes", FLAGS.mbytes)), FLAGS.timeout, FLAGS.waves,
                     tuple(common.parse_ints("processes", FLAGS.processes)), FLAGS.d, FLAGS.ps_mbytes)


def _timed_recv(node, src: int, tag: str) -> float:
  t = time.perf_counter()
  arrays = node.recv(src, tag, timeout_s=120)
  jax.block_until_ready(arrays)
  return time.perf_counter() - t


def worker() -> int:
  """One process of the job: process 0 pushes then serves pulls, process 1 receives then pulls."""
  node = join(os.environ["COORD"], 2, int(os.environ["PID"]), local_devices=2)
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


def transport(config: BenchConfig) -> tuple[float, float]:
  """Part 1; returns (GB/s at the largest size, both directions; its ratio to a local copy)."""
  sizes = config.mbytes
  env = child_environment()
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "timings.json")
    job_env = {**env, "COORD": f"127.0.0.1:{free_port()}", "SIZES": ",".join(map(str, sizes)),
               "REPS": str(config.reps), WORKER_ENV: out}
    cmd = [sys.executable, "-m", "experiments.bench_multiprocess", "--worker"]
    result = launch([cmd, cmd], [{**job_env, "PID": "0"}, {**job_env, "PID": "1"}], config.timeout, grace_s=30)
    if not result.ok:
      raise SystemExit(f"error: the transport job failed: {result.message}")
    timings = {}
    for process in (1, 0):  # each receiver timed its own direction; the local copy: process 1's
      with open(f"{out}.{process}", encoding="utf-8") as f:
        timings = {**json.load(f), **timings}
  print("1. transport: two CPU processes on loopback, median of --reps messages per size and direction; a "
        "message = offer on the transfer server + notice in the key-value store + pull")
  print(f"{'MB':>5} {'push GB/s':>10} {'pull GB/s':>10} {'local copy GB/s':>16} {'transport / local':>18}")
  rate = lambda key, mb: mb * (1 << 20) / statistics.median(timings[f"{key}:{mb}"]) / 1e9
  for mb in sizes:
    push, pull, local = rate("push", mb), rate("pull", mb), rate("local", mb)
    print(f"{mb:>5} {push:10.2f} {pull:10.2f} {local:16.2f} {(push + pull) / 2 / local:18.2f}")
  big = max(sizes)
  gbytes = (rate("push", big) + rate("pull", big)) / 2
  return gbytes, gbytes / rate("local", big)


def _layout(processes: int) -> tuple[int, int]:
  """(virtual workers, stages each) of the per-task run on ``processes`` nodes of one GPU each: one virtual
  worker across them, or, past the MLP's 4 units, virtual workers of 4 stages."""
  return (1, processes) if processes <= 4 else (processes // 4, 4)


def task_overhead(config: BenchConfig, out_dir: str, processes: int) -> float:
  """Part 2 on ``processes`` nodes; returns multiprocess / wall seconds per task."""
  vws, stages = _layout(processes)
  if vws * stages != processes:
    raise SystemExit(f"error: --processes={processes}: give 2, 3, 4 or a multiple of 4")
  cluster = os.path.join(out_dir, f"nodes{processes}.toml")
  with open(cluster, "w", encoding="utf-8") as f:  # one GPU per node, the classes A-D in turn
    f.write(f'name = "nodes{processes}"\n[links]\nintra_node = "pcie3"\ninter_node = "ib_fdr56"\n')
    f.write("".join(f'[[nodes]]\ngpus = ["{"ABCD"[i % 4]}"]\n' for i in range(processes)))
  flags_ = [f"--num_vws={vws}", f"--stages={stages}", "--nm=2", f"--d={config.d}", f"--waves={config.waves}",
            "--batch_size=32"]
  summary = common.run_train_job(["--executor=multiprocess", f"--cluster={cluster}", "--model=mlp",
                                  "--dataset=synthetic", f"--eval_every={config.waves}", *flags_],
                                 os.path.join(out_dir, str(processes)), config.timeout)
  tasks = config.waves * 2 * processes * 2  # waves x Nm minibatches x stages of every VW x (forward, backward)
  wall = run_hetpipe(get_model("mlp"), synthetic(), RunConfig.of(
      cluster=cluster, num_vws=vws, stages=stages, nm=2, d=config.d, waves=config.waves, batch_size=32, executor="wall",
      cuts=summary["cuts"], eval_every=config.waves))
  common.require_wsp(wall.events, "wall run")
  per_task = {"multiprocess": summary["seconds"] / tasks, "wall": wall.seconds / tasks}
  print(f"2. per-task overhead: {vws} virtual worker(s) x {stages} stages on {processes} nodes, Nm=2, "
        f"D={config.d}, MLP, {tasks} tasks, no padding (trace checked)")
  for name, seconds in per_task.items():
    print(f"   {name:13} {seconds * 1e3:7.3f} ms per task")
  print(f"   multiprocess - wall: {(per_task['multiprocess'] - per_task['wall']) * 1e3:.3f} ms per task")
  return per_task["multiprocess"] / per_task["wall"]


def ps_apply(config: BenchConfig) -> float:
  """Part 3; returns the apply's GB/s over the donated add's."""
  n = config.ps_mbytes * (1 << 20) // 4 // 4  # float32 elements per unit
  params = [{"w": jnp.full((n,), 1.0, jnp.float32)} for _ in range(4)]
  ps = ParameterServer(params, num_vws=1, d=0)
  ps.warm_up()
  moved = 3 * 4 * n * 4  # bytes read (weights, update) and written (weights) per push

  def timed(step) -> float:
    times = []
    for r in range(config.reps + 1):
      update = jax.block_until_ready([{"w": jnp.full((n,), 1e-3 * r, jnp.float32)} for _ in range(4)])
      t = time.perf_counter()
      jax.block_until_ready(step(r, update))
      if r:  # the first one warms up
        times.append(time.perf_counter() - t)
    return moved / statistics.median(times) / 1e9

  waves = itertools.count()

  def push(nonfinite):
    def run(r, update):
      del r
      ps.push(0, next(waves), dict(enumerate(update)), nonfinite)
      return ps.state.params
    return run
  checked_by_server = timed(push(None))
  apply = timed(push([]))  # the multi-process runtime's: its stages checked the update
  check = timed(lambda r, update: nonfinite_units(update))  # what that check costs the stages
  add = lambda p, u: jax.tree.map(jnp.add, p, u)
  state = {"donated": jax.tree.map(jnp.copy, params), "plain": jax.tree.map(jnp.copy, params)}
  programs = {"donated": jax.jit(add, donate_argnums=0), "plain": jax.jit(add)}

  def step(name):
    def run(r, update):
      del r
      state[name] = programs[name](state[name], update)
      return state[name]
    return run
  rates = {name: timed(step(name)) for name in programs}
  print(f"3. PS apply: a push of {config.ps_mbytes} MB of weights (4 units, optax.identity) on the host CPU, "
        f"{moved / 1e9:.2f} GB read and written per push; median of --reps pushes")
  for name, rate in (("apply, checked by its producer (multiprocess)", apply),
                     ("apply, checked by the server (one process)", checked_by_server),
                     ("donated add", rates["donated"]), ("add, not donated", rates["plain"])):
    print(f"   {name:46} {rate:7.2f} GB/s  ({moved / rate / 1e9 * 1e3:7.1f} ms per push)")
  print(f"   {'the producer check itself (at the stages)':46} {moved / check / 1e9 * 1e3:7.1f} ms for the same update")
  return apply / rates["donated"]


def main(argv):
  del argv
  config = config_from_flags()
  common.ensure_devices(2)
  gbytes, ratio_local = transport(config)
  counts = list(config.processes)
  with tempfile.TemporaryDirectory() as out_dir:
    overheads = {p: task_overhead(config, out_dir, p) for p in counts}
  apply_ratio = ps_apply(config)
  print(f"CPU emulation on this machine; transport at the largest size is {ratio_local:.3f} of a local copy")
  extra = f" overhead_ratios={','.join(f'{p}:{r:.3f}' for p, r in overheads.items())}" if len(counts) > 1 else ""
  print(f"transport_gbytes_per_s={gbytes:.3f} overhead_ratio={overheads[counts[0]]:.3f} "
        f"ps_apply_ratio={apply_ratio:.3f}{extra}")


if __name__ == "__main__":
  if "--worker" in sys.argv:
    sys.exit(worker())
  common.console(main)()
