r"""Host overhead of hetpipe_jax against plain jitted JAX, measured in one run on this machine.

1. Throughput ratio: hetpipe_jax with one virtual worker, one stage, Nm = 1, D = 0 (``wall`` executor)
   over a plain single-device jitted SGD loop, same model (small CNN), same batches, same optimizer.
   Goal >= 0.90. Rounds alternate which runs first; the median ratio is reported.
2. Host overhead per stage task: a 4-stage tiny MLP (one virtual worker, Nm = 4) against the same stage
   programs called back to back in a plain Python loop, (T_hetpipe - T_plain) / tasks. Goal < 100 us.

CPU emulation: both sides run on the same CPU devices, so the ratios are what the framework's host work
costs, not GPU figures. The last line is machine-readable::

  overhead_ratio=<x> task_overhead_us=<y>

  python -m experiments.bench_overhead
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from absl import flags

from experiments import common
from hetpipe_jax import MinibatchStreams, RunConfig, get_model, load_dataset, run_hetpipe, synthetic
from hetpipe_jax.models import cross_entropy
from hetpipe_jax.models.base import DenseUnit, LayeredModel

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 300, "Minibatches per timed throughput run.")
flags.DEFINE_integer("rounds", 4, "Alternating rounds of (plain, hetpipe).")
flags.DEFINE_integer("tiny_waves", 100, "Waves of the 4-stage tiny-model run (Nm = 4).")
flags.DEFINE_string("dataset", "auto", "Dataset for the throughput ratio.")


def plain_sgd(model, tx):
  """A plain single-device jitted SGD step: the baseline."""

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def plain_sgd_seconds(step, tx, batches, params, steps: int, warm_up: int = 20) -> float:
  """Seconds for ``steps`` plain SGD steps on the same batches, after ``warm_up`` untimed ones."""
  opt_state = tx.init(params)
  for p in range(1, warm_up + 1):
    jax.block_until_ready(step(params, opt_state, *batches(0, p)))
  t = time.perf_counter()
  for p in range(1, steps + 1):
    params, opt_state, _ = step(params, opt_state, *batches(0, p))
  jax.block_until_ready(params)
  return time.perf_counter() - t


def plain_stage_loop_seconds(vws, batches, total_mbs: int) -> float:
  """The stage programs of one virtual worker called back to back (fwd 0..k-1, bwd k-1..0 per minibatch)."""
  stages = vws[0].stages
  t = time.perf_counter()
  for mb in range(1, total_mbs + 1):
    x, y = batches(0, mb)
    for stage in stages:
      x = stage.forward(mb, jax.device_put(x, stage.device),
                        jax.device_put(y, stage.device) if stage.is_last else None)
    g = None
    for stage in reversed(stages):
      g = stage.backward(mb, None if g is None else jax.device_put(g, stage.device))
  jax.block_until_ready([s.params for s in stages])
  return time.perf_counter() - t


def throughput_ratio(dataset_name: str, steps: int, rounds: int) -> float:
  """1. hetpipe_jax with one stage over a plain jitted SGD loop, ``steps`` steps each, the median over
  ``rounds`` rounds; prints each round."""
  dataset = load_dataset(dataset_name)
  model = get_model("cnn", dataset.num_classes)
  batches = MinibatchStreams(dataset, 32, num_vws=1, seed=0)
  params = model.init(jax.random.key(0), jnp.asarray(dataset.x_train[:32]))
  config = RunConfig.of(cluster="uniform8", num_vws=1, stages=1, nm=1, d=0, waves=steps, batch_size=32,
                        tx=optax.sgd(0.05), executor="wall", eval_every=steps)  # evaluate once, at the end
  ratios, stage_ratios = [], []
  print(f"throughput: small CNN on {dataset.name}, batch 32, {steps} steps, CPU emulation")
  tx = optax.sgd(0.05)
  step = plain_sgd(model, tx)
  for r in range(rounds):  # alternate which side runs first
    if r % 2:
      result = run_hetpipe(model, dataset, config)
    plain = plain_sgd_seconds(step, tx, batches, params, steps)
    if not r % 2:
      result = run_hetpipe(model, dataset, config)
    common.require_wsp(result.events, f"throughput round {r}")
    programs = plain_stage_loop_seconds(result.vws, batches, steps)
    ratios.append(plain / result.seconds)
    stage_ratios.append(programs / result.seconds)
    print(f"  round {r}: plain jitted SGD {steps / plain:6.1f} steps/s   hetpipe_jax "
          f"{steps / result.seconds:6.1f} steps/s   its stage programs back to back "
          f"{steps / programs:6.1f} steps/s")
  ratio = statistics.median(ratios)
  print(f"throughput ratio hetpipe_jax / plain jitted SGD (median of {len(ratios)}): {ratio:.3f} "
        "(goal >= 0.90)")
  print(f"throughput ratio hetpipe_jax / its own stage programs called in a plain async loop: "
        f"{statistics.median(stage_ratios):.3f}")
  return ratio


def task_overhead_us(waves: int) -> dict[str, float]:
  """2. Host overhead per stage task of a 4-stage tiny MLP over ``waves`` waves, per executor (wall, virtual);
  prints each."""
  tiny = LayeredModel("tiny", tuple(DenseUnit(16) for _ in range(3)) + (DenseUnit(10, relu=False),),
                      ("d0", "d1", "d2", "logits"))
  data = synthetic(num_train=512, num_test=64)
  tiny_batches = MinibatchStreams(data, 8, num_vws=1, seed=0)
  nm = 4
  tasks = 2 * 4 * nm * waves
  print(f"host overhead: 4-stage tiny MLP (16 wide, batch 8), 1 virtual worker, Nm={nm}, {waves} waves "
        f"= {tasks} stage tasks, CPU emulation")
  overhead = {}
  for executor in ("wall", "virtual"):
    tiny_config = RunConfig.of(cluster="uniform8", num_vws=1, stages=4, nm=nm, d=0, waves=waves,
                               batch_size=8, tx=optax.sgd(0.05), executor=executor,
                               eval_every=waves)  # evaluate once, at the end
    result = run_hetpipe(tiny, data, tiny_config)
    common.require_wsp(result.events, f"tiny MLP, {executor} executor")
    plain = plain_stage_loop_seconds(result.vws, tiny_batches, nm * waves)
    seconds = result.seconds if executor == "wall" else result.wall_seconds
    overhead[executor] = (seconds - plain) / tasks * 1e6
    print(f"  {executor:7s}: hetpipe_jax {seconds * 1e6 / tasks:6.1f} us/task, same stage programs back "
          f"to back {plain * 1e6 / tasks:6.1f} us/task -> overhead {overhead[executor]:6.1f} us/task")
  print("  (stage programs compiled before timing; wall: one host thread per device, virtual: one host thread)")
  return overhead


def main(argv):
  del argv
  common.ensure_devices(4)
  ratio = throughput_ratio(FLAGS.dataset, FLAGS.steps, FLAGS.rounds)
  overhead = task_overhead_us(FLAGS.tiny_waves)
  print(f"overhead_ratio={ratio:.3f} task_overhead_us={overhead['wall']:.1f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
