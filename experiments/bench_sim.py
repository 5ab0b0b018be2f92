r"""How fast the ``sim`` executor is: 1,000 waves of the paper's 16-GPU testbed.

VGG-19 (224x224, batch 32) on ``paper_testbed`` under ED: 4 virtual workers x 4 stages, Nm = 4, D = 0,
default placement. Goal: under 2 s here. Prints events per second; the last line is
``sim_seconds_1000_waves=<s>``::

  python -m experiments.bench_sim
"""

from __future__ import annotations

import time

from absl import flags

from experiments import common
from hetpipe_jax import check_trace, get_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.sim import SimJob, simulate

FLAGS = flags.FLAGS
flags.DEFINE_integer("waves", 1000, "Waves per virtual worker.")


def main(argv):
  del argv
  cluster = get_cluster("paper_testbed")
  profiles = full_size_profiles("vgg19", 32)
  plan = plan_cluster(cluster, profiles, "ED", nm_policy=4,
                      costs=CostContext(optimizer_slots=optimizer_slots("momentum")))
  trace = Trace()
  t = time.perf_counter()
  seconds, vws, _ = simulate(SimJob(cluster, profiles, plan.layout, 0, FLAGS.waves), trace)
  host = time.perf_counter() - t
  images = sum(vw.completed for vw in vws) * 32
  print(f"simulated {FLAGS.waves} waves x 4 virtual workers x 4 stages, Nm=4 (VGG-19, ED): "
        f"{len(trace.events):,} events in {host:.2f} s = {len(trace.events) / host:,.0f} events/s; "
        f"simulated {seconds:.1f} s of training, {images / seconds:.1f} images/s")
  t = time.perf_counter()
  violations = check_trace(trace.events)
  print(f"trace check: {'OK' if not violations else violations[:3]} ({time.perf_counter() - t:.2f} s)")
  if violations:
    raise common.TraceCheckError(f"the simulated trace breaks WSP, {len(violations)} violations")
  print(f"goal < 2 s: {'met' if host < 2 else 'MISSED'}")
  print(f"sim_seconds_1000_waves={host * 1000 / FLAGS.waves:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
