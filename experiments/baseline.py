r"""Simulate one peer system on a cluster: Horovod, heterogeneity-aware data parallelism, synchronous
heterogeneous pipelines, local SGD / DiLoCo (:mod:`hetpipe_jax.baselines`).

Every peer runs on the ``sim`` executor's network (flows sharing a node's links), cost model, catalogue
and memory model, as HetPipe does. Prints images/s (tokens/s for a GPT), the efficiency against the ideal
heterogeneous aggregate, the time breakdown per GPU, writes the timeline (which
``python -m hetpipe_jax.efficiency`` reads) and a breakdown chart; the last line is
``images_per_sec=<x> efficiency=<y>``::

  python -m experiments.baseline --system=hetero_dp --model=vgg19 --cluster=paper_testbed
  python -m experiments.baseline --system=sync_pipeline --model=resnet152 --microbatches=64 --policy=HD
  python -m experiments.baseline --system=local_sgd --local_steps=16 --h_by_speed --model=resnet152
  python -m experiments.baseline --system=horovod --model=gpt2-xl --cluster=mixed64 --batch_size=8

Systems: every one of the registry (:mod:`hetpipe_jax.systems`: ``--system=list`` prints what each does), and
those a ``--systems_module=package.module`` registers.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import common, peer_flags
from hetpipe_jax import efficiency, get_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import check_activations
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.precision import check_precision
from hetpipe_jax.recompute import check_recompute
from hetpipe_jax.systems import get_system, systems

FLAGS = flags.FLAGS
flags.DEFINE_string("system", "hetero_dp", "System (hetpipe_jax.systems): horovod, hetero_dp, sync_pipeline, "
                    "local_sgd, gpipe, ps_sync, ps_replicated, tf_replicated, tf_replicated_copy, hetpipe, or one a "
                    "--systems_module registers (list: each one's summary).")
flags.DEFINE_string("model", "vgg19", "vgg19, resnet152 (224x224x3), gpt2-xl, gpt-6.7b, gpt-13b (--seq_len tokens), "
                    "or mlp, cnn, vgg, resnet (28x28x1), gpt.")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset, mixed<N>[x<G>] or a .toml file.")
flags.DEFINE_integer("batch_size", 32, "Examples per minibatch (per GPU for horovod and local_sgd, per microbatch "
                     "for pipelines; hetero_dp's default global batch is this x the cluster's GPUs).")
flags.DEFINE_integer("seq_len", None, "GPT models: tokens per sequence (default: the model's context).")
flags.DEFINE_string("optimizer", "momentum", "Local optimizer, for its memory: sgd, momentum, adam, adamw, muon.")
flags.DEFINE_string("precision", "fp32", "fp32, fp16 or bf16 (mixed precision).")
flags.DEFINE_string("recompute", "none", "Activation recomputation: none, selective or full on every GPU, or auto "
                    "(a peer: the fastest of the three it can run; hetpipe: the planner's choice per stage).")
flags.DEFINE_string("activations", "jax", common.ACTIVATIONS_HELP)
flags.DEFINE_string("out_dir", "outputs/baseline", "Where the timeline, breakdown JSON and chart go.")


def main(argv):
  del argv
  knobs = peer_flags.knobs_from_flags(FLAGS)
  if FLAGS.system == "list":
    for name, system in systems().items():
      print(f"{name:18} {system.summary}")
    return
  system = get_system(FLAGS.system)
  if FLAGS.batch_size < 1:
    raise common.config_error(f"--batch_size={FLAGS.batch_size}; give a batch size >= 1")
  check_precision(FLAGS.precision)
  cluster = get_cluster(FLAGS.cluster)
  profiles, per_example, unit = common.batch_profiles(FLAGS.model, FLAGS.batch_size, FLAGS.seq_len)
  costs = CostContext(weight_mode="stash", optimizer_slots=optimizer_slots(FLAGS.optimizer), precision=FLAGS.precision,
                      recompute=check_recompute(FLAGS.recompute),
                      activations=check_activations(FLAGS.activations))
  common.progress("simulating %s: %s on %s, batch %d", FLAGS.system, FLAGS.model, cluster.name, FLAGS.batch_size)
  run = system.simulate(cluster, profiles, FLAGS.batch_size, knobs, costs, FLAGS.model)
  if run.timeline is not None:
    name = f"{FLAGS.system}_{FLAGS.model}_{cluster.name}.timeline.json"
    timeline_path = common.write_json(common.output_path(FLAGS.out_dir, name), run.timeline, indent=None)
    print(f"timeline {os.path.abspath(timeline_path)}")
    efficiency.main(["hetpipe_jax.efficiency", timeline_path])  # the breakdown per GPU, its JSON and chart
  else:
    name = f"{FLAGS.system}_{FLAGS.model}_{cluster.name}.trace.jsonl"
    trace_path = common.write_jsonl(common.output_path(FLAGS.out_dir, name), run.events)
    print(f"trace {os.path.abspath(trace_path)}")
  meta = run.meta
  setting = {k: v for k, v in meta.items() if k in ("gpus", "shares", "accumulation", "microbatches", "nm", "window",
                                                    "local_steps", "global_batch", "policy", "fusion_mb",
                                                    "state_shards", "shard_weights", "recompute")}
  print(f"{FLAGS.system}: {setting or system.config(run)}")
  print(f"one round (step) {run.round_seconds * 1e3:.2f} ms for {run.examples_per_round} examples; ideal aggregate "
        f"{run.ideal_images_per_sec * per_example:.1f} {unit}/s")
  print("simulated cluster (cost model: roofline with the calibrated catalogue, links of the preset); not measured")
  print(f"{unit}/s {run.images_per_sec * per_example:.1f}  efficiency {run.efficiency:.3f}")
  print(f"images_per_sec={run.images_per_sec * per_example:.6g} efficiency={run.efficiency:.4f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
