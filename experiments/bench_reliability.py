r"""What reliability costs, measured in one run on this machine.

1. **Checkpoint cost of the default run** (the small CNN, 3 virtual workers x 2 stages on ``hetero4``,
   ``virtual`` executor, ``--waves`` waves): the run with a checkpoint every ``--every`` global clock
   ticks against the same run without, and the seconds and bytes of each checkpoint.
2. **Checkpoint cost at VGG-19 size**: one checkpoint holding VGG-19's weights (548 MB of float32) twice,
   as the parameter server's global weights and as one virtual worker's stage weights (what a run with
   one virtual worker keeps; every further virtual worker adds one more copy), saved with the same
   :class:`~hetpipe_jax.runtime.numerics.checkpoint.Checkpointer` (orbax) to a temporary directory.
3. **What a failure costs in throughput**: VGG-19 on the simulated paper testbed (HD, ``sim`` executor,
   ``--waves`` waves): images/s with no failure, with one virtual worker lost at a third of the run,
   and with that one replaced (``rejoin``).

Last line::

  checkpoint_seconds_default=<s> checkpoint_mb_default=<MB> checkpoint_seconds_vgg19=<s>
  checkpoint_gb_vgg19=<GB> failure_throughput_ratio=<lost/none> rejoin_throughput_ratio=<rejoined/none>

  python -m experiments.bench_reliability
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import flags

from experiments import common
from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe
from hetpipe_jax.models import FULL_SIZE, full_size_input, full_size_model
from hetpipe_jax.runtime.numerics.checkpoint import Checkpointer

FLAGS = flags.FLAGS
flags.DEFINE_integer("waves", 60, "Waves of the default-run and failure measurements.")
flags.DEFINE_integer("every", 10, "Global clock ticks between checkpoints in the default run.")


def default_run(tmp: str, waves: int, every: int) -> tuple[float, float]:
  """Part 1 (``waves`` waves, a checkpoint every ``every`` ticks); returns (seconds per checkpoint, MB per
  checkpoint)."""
  data = load_dataset("auto")
  model = get_model("cnn", data.num_classes)
  base = dict(waves=waves, trace_path=os.path.join(tmp, "trace.jsonl"))
  run_hetpipe(model, data, RunConfig.of(**base))  # warm the caches (compilation, profiles)
  t = time.perf_counter()
  plain = run_hetpipe(model, data, RunConfig.of(**base))
  plain_s = time.perf_counter() - t
  t = time.perf_counter()
  saved = run_hetpipe(model, data, RunConfig.of(**base, checkpoint_dir=os.path.join(tmp, "ck"),
                                             checkpoint_every=every))
  saved_s = time.perf_counter() - t
  common.require_wsp(saved.events, "checkpointed run")
  assert saved.checkpoints is not None
  seconds, mbytes = statistics.median(saved.checkpoints["seconds"]), saved.checkpoints["bytes"][-1] / 1e6
  same = plain.metrics == saved.metrics and plain.events == saved.events
  print(f"1. default run ({model.name} on {data.name}, {waves} waves, virtual executor): "
        f"{plain_s:.2f} s without checkpoints, {saved_s:.2f} s with {saved.checkpoints['saved']} (every "
        f"{every} ticks): {seconds:.3f} s and {mbytes:.2f} MB per checkpoint; ratio "
        f"{saved_s / plain_s:.3f}; results identical: {same}")
  return seconds, mbytes


def vgg19_checkpoint(tmp: str) -> tuple[float, float]:
  """Part 2; returns (seconds, GB) of one checkpoint."""
  model = full_size_model("vgg19")
  shapes = jax.eval_shape(model.init, jax.random.key(0), full_size_input("vgg19", 1))
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  state = {"server": params, "stage": jax.tree.map(jnp.copy, params)}
  checkpointer = Checkpointer(os.path.join(tmp, "vgg19"), 1, 1, {"model": "vgg19"})
  times = []
  for step in (1, 2):
    t = time.perf_counter()
    checkpointer.save(step, state, {})
    times.append(time.perf_counter() - t)
  checkpointer.close()
  gbytes = checkpointer.bytes[-1] / 1e9
  print(f"2. VGG-19-sized state (weights twice: server + one virtual worker's stages): {gbytes:.2f} GB, "
        f"{times[-1]:.2f} s per checkpoint ({gbytes / times[-1]:.2f} GB/s; first save {times[0]:.2f} s)")
  return times[-1], gbytes


def failure_cost(waves: int) -> tuple[float, float]:
  """Part 3 (``waves`` waves); returns (images/s with a lost virtual worker, with a replacement) over images/s
  without."""
  model = full_size_model("vgg19")
  rates = {}
  fault = [(1, waves // 3)]
  for name, failures, rejoin in (("no failure", [], False), ("VW 1 lost", fault, False),
                                 ("VW 1 replaced", fault, True)):
    config = RunConfig.of(cluster="paper_testbed", policy="HD", waves=waves, executor="sim",
                          failures=failures, rejoin=rejoin)
    result = run_hetpipe(model, FULL_SIZE["vgg19"], config)
    common.require_wsp(result.events, f"sim run ({name})")
    rates[name] = result.images_per_second
  print(f"3. VGG-19 on the simulated paper testbed (HD, {waves} waves, failure at wave "
        f"{waves // 3}): " + ", ".join(f"{k} {v:.1f} images/s" for k, v in rates.items()))
  return rates["VW 1 lost"] / rates["no failure"], rates["VW 1 replaced"] / rates["no failure"]


def main(argv):
  del argv
  common.ensure_devices(8)
  with tempfile.TemporaryDirectory() as tmp:
    seconds, mbytes = default_run(tmp, FLAGS.waves, FLAGS.every)
    vgg_seconds, vgg_gbytes = vgg19_checkpoint(tmp)
  lost, rejoined = failure_cost(FLAGS.waves)
  print("CPU emulation on this machine (checkpoints to local disk); simulated cluster time for part 3")
  print(f"checkpoint_seconds_default={seconds:.4f} checkpoint_mb_default={mbytes:.3f} "
        f"checkpoint_seconds_vgg19={vgg_seconds:.3f} checkpoint_gb_vgg19={vgg_gbytes:.3f} "
        f"failure_throughput_ratio={lost:.3f} rejoin_throughput_ratio={rejoined:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
