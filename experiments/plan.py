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
  python -m experiments.plan --model=gpt2-xl --batch_size=8 --precision=bf16 --optimizer=adam --tp=auto

A GPT too large for any one GPU (6.7B parameters: 16 bytes each with Adam, in fp32 or mixed precision)
is cut over the GPUs of one virtual worker; the table shows every stage's memory against its GPU's.
"""

from __future__ import annotations

from absl import flags

from experiments import common, run_flags
from hetpipe_jax import get_cluster
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import check_activations
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.allocation import parse_policy, plan_cluster
from hetpipe_jax.plan.plan_json import plan_table, plan_to_json
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.precision import check_precision
from hetpipe_jax.sim.planned import simulate_plan

FLAGS = flags.FLAGS
# The run settings a plan takes (experiments.run_flags), at the planner's defaults: the paper's testbed and
# VGG-19, ED, momentum (for its memory).
run_flags.define(["model", "cluster", "policy", "placement", "batch_size", "seq_len", "optimizer", "weight_mode",
                  "precision", "recompute", "tp", "d"],
                 overrides={"model": "vgg19", "cluster": "paper_testbed", "policy": "ED", "optimizer": "momentum"})
flags.adopt_module_key_flags(run_flags)  # --help lists them
flags.DEFINE_string("nm", "max_fit", "Nm: max_fit (largest that fits, <= nm_max), best (modelled "
                    "throughput), speed (waves sized to each virtual worker's speed, beyond max_fit with a window "
                    "of it: hetpipe_jax.plan.waves), or a number.")
flags.DEFINE_integer("nm_max", None, "Largest Nm to consider in flight (default: GPUs per virtual worker; a "
                     "--nm=speed wave may be longer, with a window).")
flags.DEFINE_bool("simulate", True, "Simulate the plan (sim executor, fast mode) for the images/s printed; "
                  "--nosimulate prints the planner's bound only.")
flags.DEFINE_string("activations", "jax", common.ACTIVATIONS_HELP)
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
                      CostContext(weight_mode=FLAGS.weight_mode, optimizer_slots=slots, precision=FLAGS.precision,
                                  recompute=FLAGS.recompute,
                                  activations=check_activations(FLAGS.activations)), parse_tp(FLAGS.tp))
  simulated = simulate_plan(cluster, profiles, plan, FLAGS.batch_size, d=FLAGS.d, weight_mode=FLAGS.weight_mode,
                            precision=FLAGS.precision).to_json() if FLAGS.simulate else None
  doc = plan_to_json(cluster, profiles, plan, FLAGS.model, FLAGS.batch_size, FLAGS.precision, simulated)
  print(plan_table(doc))
  common.write_json(common.ensure_parent(FLAGS.out), doc)
  common.print_outputs([("plan", FLAGS.out)])


cli = common.console(main)

if __name__ == "__main__":
  cli()
