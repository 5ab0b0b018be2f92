r"""Per-step time of one stage's programs in fp32 against bf16 (mixed precision), measured in one run.

The default CNN as one stage on one device: a step is a forward and a backward with its local update
(:class:`hetpipe_jax.runtime.numerics.stage.Stage`), at the default batch size. Rounds alternate which precision runs
first; the median step time of each is reported, and their ratio. CPU emulation: XLA's CPU backend has no
bf16 arithmetic units, so this measures what the casts cost there, not what a GPU gains::

  python -m experiments.bench_precision
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from absl import flags

from experiments import common
from hetpipe_jax import get_model, load_dataset
from hetpipe_jax.runtime.numerics.stage import Stage, StageOptions

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "Steps per timed run.")
flags.DEFINE_integer("rounds", 3, "Alternating rounds of (fp32, bf16).")
flags.DEFINE_integer("batch_size", 32, "Minibatch size.")


def step_seconds(precision: str, model, x, y, steps: int) -> float:
  """Median seconds of one forward + backward of the whole model as one stage at ``precision``, over
  ``steps`` steps."""
  params = model.init(jax.random.key(0), x)
  stage = Stage(model, range(model.num_units), params, jax.devices()[0], optax.sgd(0.05), 1,
                StageOptions(precision=precision))
  stage.warm_up(x, y)
  times = []
  for mb in range(1, steps + 1):
    t = time.perf_counter()
    stage.forward(mb, x, y)
    stage.backward(mb, None)
    jax.block_until_ready(stage.params)
    times.append(time.perf_counter() - t)
    stage.take_wave(mb - 1)
  return statistics.median(times)


def main(argv) -> None:
  del argv
  data = load_dataset("auto")
  model = get_model("cnn", data.num_classes)
  x, y = jnp.asarray(data.x_train[:FLAGS.batch_size]), jnp.asarray(data.y_train[:FLAGS.batch_size])
  seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
  for r in range(FLAGS.rounds):
    for precision in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
      seconds[precision].append(step_seconds(precision, model, x, y, FLAGS.steps))
  fp32, bf16 = statistics.median(seconds["fp32"]), statistics.median(seconds["bf16"])
  print(f"CPU emulation: step fp32 {fp32 * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms")
  print(f"bf16_over_fp32={bf16 / fp32:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
