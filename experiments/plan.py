r"""Plan how to train a model on a heterogeneous cluster: virtual workers, partitions, Nm, PS placement.

Profiles the model (XLA cost analysis of every unit, cached), groups the cluster's GPUs into virtual
workers (NP, ED, HD or a grouping), cuts the model for each virtual worker's GPUs (exact DP over cuts and
device orders), picks Nm, places the PS shards, simulates the plan on the ``sim`` executor (the images/s
it prints is the simulator's; the planner's own sum of the virtual workers' rates is printed beside it as a
bound), names the GPUs and links it uses, prints a table per virtual worker and writes JSON with every
number needed to recheck the plan::

  python -m experiments.plan --model=vgg19 --cluster=paper_testbed --policy=ED --out=plan.json
  python -m experiments.plan --model=resnet152 --policy=HD --placement=local
  python -m experiments.plan --model=cnn --cluster=my_lab.toml --policy=0,1,2,3;4,5
  python -m experiments.plan --model=gpt-6.7b --seq_len=1024 --batch_size=1 --precision=bf16 \
      --optimizer=adam --policy=0,1,2,3,4,5,6,7 --nm=best

A GPT too large for any one GPU (6.7B parameters: 16 bytes each with Adam, in fp32 or mixed precision)
is cut over the GPUs of one virtual worker; the table shows every stage's memory against its GPU's.
"""

from __future__ import annotations

from absl import flags

from experiments import common
from hetpipe_jax import get_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.allocation import parse_policy, plan_cluster
from hetpipe_jax.plan.plan_json import plan_table, plan_to_json
from hetpipe_jax.precision import check_precision
from hetpipe_jax.sim.planned import simulate_plan

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "vgg19", "vgg19, resnet152 (224x224x3 inputs), gpt2-xl, gpt-6.7b, gpt-13b "
                    "(--seq_len tokens), or mlp, cnn, vgg, resnet (28x28x1), gpt (16 tokens of 32), or "
                    "package.module:factory (your model, on its input_shape).")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or a .toml file.")
flags.DEFINE_string("policy", "ED", "NP, ED, HD, or a grouping of GPU indices: '0,1;2,3'.")
flags.DEFINE_string("placement", "default", "PS shard placement: default, local or striped.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size (a GPT's: sequences per minibatch).")
flags.DEFINE_integer("seq_len", None, "GPT models: tokens per sequence (default: the model's context).")
flags.DEFINE_string("nm", "max_fit", "Nm: max_fit (largest that fits, <= nm_max), best (modelled "
                    "throughput), or a number.")
flags.DEFINE_integer("nm_max", None, "Largest Nm to consider (default: GPUs per virtual worker).")
flags.DEFINE_string("optimizer", "momentum", "Local optimizer, for its memory: sgd, momentum, adam.")
flags.DEFINE_string("weight_mode", "stash", "stash (Nm-1 stashed weight copies) or latest.")
flags.DEFINE_string("precision", "fp32", "fp32, fp16 or bf16 (mixed precision: 16-bit weights, gradients and "
                    "activations, fp32 master weights and optimizer state) for time and memory.")
flags.DEFINE_integer("d", 1, "The WSP bound D of the simulated run (as experiments.train's --d).")
flags.DEFINE_bool("simulate", True, "Simulate the plan (sim executor, fast mode) for the images/s printed; "
                  "--nosimulate prints the planner's bound only.")
flags.DEFINE_string("out", "outputs/plan/plan.json", "Where to write the plan JSON.")


def main(argv):
  del argv
  check_precision(FLAGS.precision)
  if FLAGS.d < 0:
    raise common.config_error(f"--d={FLAGS.d}; the WSP bound D is a whole number >= 0")
  slots = optimizer_slots(FLAGS.optimizer)
  cluster = get_cluster(FLAGS.cluster)
  profiles = common.model_profiles(FLAGS.model, FLAGS.batch_size, FLAGS.seq_len)[0]
  plan = plan_cluster(cluster, profiles, parse_policy(FLAGS.policy), FLAGS.placement, common.parse_nm(FLAGS.nm),
                      FLAGS.nm_max,
                      CostContext(weight_mode=FLAGS.weight_mode, optimizer_slots=slots, precision=FLAGS.precision))
  simulated = simulate_plan(cluster, profiles, plan, FLAGS.batch_size, d=FLAGS.d, weight_mode=FLAGS.weight_mode,
                            precision=FLAGS.precision).to_json() if FLAGS.simulate else None
  doc = plan_to_json(cluster, profiles, plan, FLAGS.model, FLAGS.batch_size, FLAGS.precision, simulated)
  print(plan_table(doc))
  common.write_json(common.ensure_parent(FLAGS.out), doc)
  common.print_outputs([("plan", FLAGS.out)])


cli = common.console(main)

if __name__ == "__main__":
  cli()
