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
from hetpipe_jax.studies.validate_sim import GOAL, SimCheck, SimValidationConfig, validate_sim

FLAGS = flags.FLAGS
flags.DEFINE_integer("waves", SimValidationConfig.waves, "Waves per virtual worker in every configuration.")


def print_table(checks: list[SimCheck]) -> None:
  print(f"{'N':>2} {'k':>7} {'Nm':>7} {'D':>2} {'speeds':24} {'measured':>10} {'predicted':>10} {'error':>7}")
  for c in checks:
    n, k, nm, d, mix = c.case
    print(f"{n:>2} {str(k):>7} {str(nm):>7} {d:>2} {'+'.join(mix):24} {c.measured:10.1f} "
          f"{c.predicted:10.1f} {c.error:7.1%}")


def main(argv):
  del argv
  config = SimValidationConfig(waves=FLAGS.waves)
  common.ensure_devices(config.devices)
  checks = validate_sim(config)
  print_table(checks)
  worst = max(c.error for c in checks)
  print(f"images/s on the emulated clock (wall: CPU emulation padded to the emulated speeds); goal: every "
        f"error < {GOAL:.0%} ({'met' if worst < GOAL else 'MISSED'})")
  print(f"worst_error={worst:.4f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
