r"""Validates the ``sim`` executor against real runs: the same cost model, measured vs. predicted.

Real runs use the ``wall`` executor on CPU devices with every task padded to its emulated duration
(``time_scale`` = 1: the emulated GPUs are slow enough that a task lasts milliseconds, so the schedule,
not CPU noise, sets the pace); the ``sim`` executor predicts the same configuration from the same cost
model. Links are fast here (100 GB/s): CPU devices have no links to compare the contention model with,
so this validates the schedule, the Nm window and WSP gating across heterogeneous speeds. Goal: every
prediction within 10%. The last line is ``worst_error=<fraction>``::

  python -m experiments.validate_sim
"""

from __future__ import annotations

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("waves", 12, "Waves per virtual worker in every configuration.")

# (virtual workers, stages each, Nm each, D, speed of each virtual worker's GPUs)
CONFIGS = [
    (1, 2, 1, 0, ("fast",)),
    (1, 4, 4, 0, ("slow",)),
    (2, 2, 2, 0, ("fast", "whimpy")),
    (2, 2, 2, 3, ("fast", "whimpy")),
    (3, 2, 3, 1, ("fast", "slow", "whimpy")),
    (2, (1, 3), (2, 3), 1, ("slow", "fast")),
]


def stages_per_vw(n: int, k) -> list[int]:
  """The stages of each of ``n`` virtual workers: ``k`` for all, or one per VW."""
  return [k] * n if isinstance(k, int) else list(k)


def main(argv):
  del argv
  common.ensure_devices(max(sum(stages_per_vw(n, k)) for n, k, *_ in CONFIGS))
  from hetpipe_jax import RunConfig, get_model, run_hetpipe, synthetic
  from hetpipe_jax.cluster import GpuType, Link, make_cluster

  # Emulated GPUs at 100, 50 and 33 Mflop/s: an MLP stage task at batch 16 lasts a few milliseconds.
  speeds = {"fast": 1e8, "slow": 5e7, "whimpy": 3.3e7}
  types = {name: GpuType(name, 1 << 33, f, f, 1e15, 1.0) for name, f in speeds.items()}
  model, data = get_model("mlp"), synthetic(num_train=512, num_test=64)
  print(f"{'N':>2} {'k':>7} {'Nm':>7} {'D':>2} {'speeds':24} {'measured':>10} {'predicted':>10} {'error':>7}")
  worst = 0.0
  for n, k, nm, d, mix in CONFIGS:
    ks = stages_per_vw(n, k)
    cluster = make_cluster("validate", [[types[mix[i]]] * ks[i] for i in range(n)], Link("fast", 1e11, 1e-6),
                           Link("fast", 1e11, 1e-6))
    # eval_every=waves: the global weights are evaluated once, at the last clock tick (no "never").
    config = RunConfig.of(cluster=cluster, num_vws=n, stages=k, nm=nm, d=d, waves=FLAGS.waves, batch_size=16,
                       eval_every=FLAGS.waves)
    measured = run_hetpipe(model, data, config.replace(executor="wall", time_scale=1.0))
    predicted = run_hetpipe(model, data, config.replace(executor="sim"))
    common.require_wsp(measured.events, f"wall run {n} x {k}, Nm={nm}, D={d}")
    common.require_wsp(predicted.events, f"sim run {n} x {k}, Nm={nm}, D={d}")
    error = abs(predicted.images_per_second - measured.images_per_second) / measured.images_per_second
    worst = max(worst, error)
    print(f"{n:>2} {str(k):>7} {str(nm):>7} {d:>2} {'+'.join(mix):24} {measured.images_per_second:10.1f} "
          f"{predicted.images_per_second:10.1f} {error:7.1%}")
  print(f"images/s on the emulated clock (wall: CPU emulation padded to the emulated speeds); goal: every "
        f"error < 10% ({'met' if worst < 0.1 else 'MISSED'})")
  print(f"worst_error={worst:.4f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
