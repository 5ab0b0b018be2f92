r"""How fast the planner and the profiler are, on this machine.

* Partitioning ResNet-152 (52 units: stem, 50 residual blocks, head) at batch 32 for one virtual worker
  of 4 GPUs of 4 distinct types (the paper testbed's; 24 device orders), and for 8 GPUs of 4 types
  (2 per type and node: 2,520 distinct orders); each with Nm chosen by max_fit (up to k partitions).
  Goals: < 1 s and < 10 s.
* Partitioning (one call, Nm=1) ResNet-152 and VGG-19 over 16 GPUs of 8 types, 2 per type on one node
  (4 nodes of 4; 16!/2^8 distinct orders, out of reach of an enumeration). Goal: < 1 s.
* Profiling VGG-19 and ResNet-152 (224x224, batch 32) cold (empty cache) and warm (cached).

Last line: ``plan_seconds_4gpu=<s> plan_seconds_8gpu=<s> partition_seconds_16gpu=<s>`` (ResNet-152)::

  python -m experiments.bench_plan
"""

from __future__ import annotations

import tempfile
import time

from experiments import common
from hetpipe_jax import get_cluster
from hetpipe_jax.cluster import make_cluster
from hetpipe_jax.cluster.catalogue import CATALOGUE
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import profile_units
from hetpipe_jax.models import full_size_input, full_size_model
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.partition import partition, plan_virtual_worker


def main(argv):
  del argv
  profiles = {}
  with tempfile.TemporaryDirectory() as cache:
    for name in ("vgg19", "resnet152"):
      model, shape = full_size_model(name), full_size_input(name, 32)
      t = time.perf_counter()
      profiles[name] = profile_units(model, shape, cache_dir=cache)
      cold = time.perf_counter() - t
      t = time.perf_counter()
      profile_units(model, shape, cache_dir=cache)
      warm = time.perf_counter() - t
      print(f"profile {name:9s} ({len(profiles[name])} units): cold {cold:6.2f} s, warm (cached) "
            f"{warm * 1e3:6.1f} ms")

  results = {}
  for label, cluster_name in (("4gpu", "paper_mini"), ("8gpu", "paper_half")):
    cluster = get_cluster(cluster_name)
    t = time.perf_counter()
    plan = plan_virtual_worker(cluster, profiles["resnet152"], list(cluster.gpus), "max_fit",
                               costs=CostContext(optimizer_slots=optimizer_slots("momentum")))
    results[label] = time.perf_counter() - t
    print(f"plan resnet152 on {cluster.num_gpus} GPUs ({cluster_name}): {results[label]:.3f} s -> Nm={plan.nm}, "
          f"order {[g.type.name for g in plan.gpus]}, cuts {plan.cuts}, "
          f"{plan.throughput * 32:.1f} images/s modelled")
  print(f"goals: 4 GPUs < 1 s ({'met' if results['4gpu'] < 1 else 'MISSED'}), 8 GPUs < 10 s "
        f"({'met' if results['8gpu'] < 10 else 'MISSED'})")
  names = ["TITAN V", "TITAN RTX", "RTX 2060", "Quadro P4000", "V100", "A100", "T4", "RTX 3090"]
  cluster = make_cluster("16gpu_8types", [[CATALOGUE[names[(4 * node + i) // 2]] for i in range(4)]
                                          for node in range(4)])
  for name in ("resnet152", "vgg19"):
    t = time.perf_counter()
    plan = partition(cluster, profiles[name], list(cluster.gpus), 1,
                     CostContext(optimizer_slots=optimizer_slots("momentum")))
    results[f"16gpu_{name}"] = time.perf_counter() - t
    print(f"partition {name} on 16 GPUs of 8 types (Nm=1): {results[f'16gpu_{name}']:.3f} s -> cuts {plan.cuts}, "
          f"{plan.throughput * 32:.1f} images/s modelled")
  print(f"goal: 16 GPUs < 1 s ({'met' if results['16gpu_resnet152'] < 1 else 'MISSED'})")
  print(f"plan_seconds_4gpu={results['4gpu']:.3f} plan_seconds_8gpu={results['8gpu']:.3f} "
        f"partition_seconds_16gpu={results['16gpu_resnet152']:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
