r"""Convergence study: HetPipe at several D against Horovod-style data parallelism and an SSP server.

Real training (real gradients, Fashion-MNIST by default) under the exact staleness pattern of an
emulated heterogeneous cluster: the ``virtual`` executor's clock is the cost model of the cluster (and,
with --time_model, of a larger model's plan on it, while the numerics train the small model). Every run
sees the same examples (same number of epochs) from the same initialisation:

* HetPipe at each D of --ds (allocation --policy, partitions and Nm from the planner);
* Horovod-style synchronous data parallelism on the GPUs that hold the whole model (time per step:
  slowest GPU + all-reduce);
* an SSP parameter server without pipelining (one worker per GPU, Nm = 1, D = --ssp_d) on those GPUs.

--whimpy=TYPE runs the 12 -> 16 GPU experiment: the baselines may not use GPUs of TYPE, HetPipe uses all.

Writes convergence.json, a CSV and PNG plots (test accuracy against emulated time and against epochs),
prints time to --target_accuracy, each HetPipe run's speedup over the data-parallel baseline, and each
HetPipe run's observed staleness (its trace passes the checker)::

  python -m experiments.convergence
  python -m experiments.convergence --time_model=vgg19 --whimpy="RTX 2060" --out_dir=outputs/whimpy
"""

from __future__ import annotations

import math
from dataclasses import replace

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "Model trained: mlp, cnn, vgg, resnet.")
flags.DEFINE_string("dataset", "auto", "auto (Fashion-MNIST, else digits), fashion_mnist, digits, synthetic.")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or .toml file.")
flags.DEFINE_string("policy", "ED", "HetPipe allocation policy: NP, ED, HD or a grouping.")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D of the HetPipe runs.")
flags.DEFINE_string("nm", "max_fit", "HetPipe Nm: max_fit, best or a number.")
flags.DEFINE_float("epochs", 1.0, "Training examples seen by every run, in epochs.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size (per worker).")
flags.DEFINE_float("learning_rate", 0.02, "SGD learning rate of every run (0.05 made the 4-VW D=0 run and the "
                   "16-worker SSP run diverge).")
flags.DEFINE_float("target_accuracy", 0.75, "Test accuracy whose emulated time is the headline.")
flags.DEFINE_string("time_model", None, "vgg19 or resnet152: time axis from this model's cost on the cluster.")
flags.DEFINE_integer("ssp_d", 4, "Staleness bound of the SSP baseline.")
flags.DEFINE_enum("horovod_lr_scale", "linear", ["linear", "none"], "Data-parallel learning rate: linear = "
                  "learning_rate x workers (its step averages their gradients; Goyal et al. 2017), none = "
                  "learning_rate.")
flags.DEFINE_string("whimpy", None, "GPU type the baselines may not use (the 12 -> 16 GPU experiment).")
flags.DEFINE_integer("eval_every", 5, "Evaluate every this many global clock ticks (baseline: steps).")
flags.DEFINE_integer("seed", 0, "Initialisation and shuffling seed, in [0, 2**63 - 1].")
flags.DEFINE_string("out_dir", "outputs/convergence", "Where the JSON, CSV and plots go.")

OPTIMIZER = "sgd"  # every run's: HetPipe's local optimizer, the SSP workers' and the data-parallel step's


def time_to(curve: list[list[float]], target: float) -> float | None:
  return next((t for t, _, acc, _ in curve if acc >= target), None)


def hetpipe_curve(metrics: list[dict], nms: list[int]) -> list[list[float]]:
  """[time, minibatches so far (all workers), test accuracy, train loss] at every evaluation."""
  curve, done = [], 0
  for row in metrics:
    done += nms[row["vw"]]
    if "test_accuracy" in row:
      curve.append([row["time"], done, row["test_accuracy"], row["train_loss"]])
  return curve


def main(argv):
  del argv
  from hetpipe_jax import ConfigError, get_cluster
  common.check_seed(FLAGS.seed)
  ds = common.parse_ints("ds", FLAGS.ds)
  cluster = get_cluster(FLAGS.cluster)
  common.ensure_devices(cluster.num_gpus)
  import jax
  import jax.numpy as jnp

  from hetpipe_jax import RunConfig, get_model, load_dataset, run_hetpipe, staleness_stats
  from hetpipe_jax.api import time_model_profiles
  from hetpipe_jax.baselines.data_parallel import train_data_parallel
  from hetpipe_jax.baselines.horovod import horovod_iteration_seconds
  from hetpipe_jax.cost.profile import profile_units
  from hetpipe_jax.optim import make_optimizer, optimizer_slots
  from hetpipe_jax.plan.allocation import horovod_gpus, parse_policy, plan_cluster

  dataset = load_dataset(FLAGS.dataset)
  model = get_model(FLAGS.model, dataset.num_classes)
  total = int(FLAGS.epochs * len(dataset.x_train) / FLAGS.batch_size)  # minibatches every run sees
  clock_profiles = (time_model_profiles(FLAGS.time_model, FLAGS.batch_size) if FLAGS.time_model else
                    profile_units(model, jax.ShapeDtypeStruct((FLAGS.batch_size,) + dataset.x_train.shape[1:],
                                                              jnp.float32)))
  time_axis = (f"cost model of {FLAGS.time_model} (batch {FLAGS.batch_size}) on {cluster.name}"
               if FLAGS.time_model else f"cost model of {model.name} on {cluster.name}")
  nm = common.parse_nm(FLAGS.nm)
  policy = parse_policy(FLAGS.policy)
  base = RunConfig(cluster=cluster, batch_size=FLAGS.batch_size, optimizer=OPTIMIZER,
                   learning_rate=FLAGS.learning_rate, seed=FLAGS.seed, eval_every=FLAGS.eval_every,
                   time_model=FLAGS.time_model, executor="virtual")
  runs = []
  for d in ds:
    nms = [p.nm for p in plan_cluster(cluster, clock_profiles, policy, "default", nm, None).vws]
    waves = max(1, math.ceil(total / sum(nms)))
    common.progress("HetPipe D=%d: %d virtual workers, Nm=%s, %d waves", d, len(nms), nms, waves)
    result = run_hetpipe(model, dataset, replace(base, policy=policy, nm=nm, d=d, waves=waves))
    common.require_wsp(result.events, f"HetPipe D={d}")
    stats = staleness_stats(result.events)
    runs.append({"name": f"HetPipe {FLAGS.policy} D={d}", "system": "hetpipe", "d": d, "nm": nms,
                 "gpus": sum(result.events[0]["stages"]), "curve": hetpipe_curve(result.metrics, nms),
                 "staleness": stats})

  gpus = [g for g in horovod_gpus(cluster, clock_profiles, optimizer_slots(OPTIMIZER)) if g.type.name != FLAGS.whimpy]
  if not gpus:
    raise ConfigError("no GPU of the cluster holds the whole model for the data-parallel baselines; use a "
                      "smaller --time_model or a cluster with larger GPUs")
  step_s = horovod_iteration_seconds(cluster, clock_profiles, gpus)
  lr = FLAGS.learning_rate * (len(gpus) if FLAGS.horovod_lr_scale == "linear" else 1)
  rows = train_data_parallel(model, dataset, make_optimizer(OPTIMIZER, lr), len(gpus), total // len(gpus),
                             FLAGS.batch_size, step_s, FLAGS.seed, FLAGS.eval_every)
  runs.append({"name": f"Horovod ({len(gpus)} GPUs)", "system": "horovod", "d": 0, "nm": [1], "lr": lr,
               "gpus": len(gpus), "curve": [[r["time"], r["step"] * len(gpus), r["test_accuracy"],
                                             r["train_loss"]] for r in rows if "test_accuracy" in r]})
  ssp = run_hetpipe(model, dataset, replace(base, policy=[[g.index] for g in gpus], nm=1, d=FLAGS.ssp_d,
                                            waves=max(1, total // len(gpus))))
  common.require_wsp(ssp.events, f"SSP D={FLAGS.ssp_d}")
  runs.append({"name": f"SSP PS ({len(gpus)} GPUs) D={FLAGS.ssp_d}", "system": "ssp", "d": FLAGS.ssp_d,
               "nm": [1], "gpus": len(gpus), "curve": hetpipe_curve(ssp.metrics, [1] * len(gpus)),
               "staleness": staleness_stats(ssp.events)})

  epoch = len(dataset.x_train) / FLAGS.batch_size
  for run in runs:
    run["time_to_target_s"] = time_to(run["curve"], FLAGS.target_accuracy)
    run["final_test_accuracy"] = run["curve"][-1][2]
  doc = {"target_accuracy": FLAGS.target_accuracy, "time_axis": time_axis, "model": model.name,
         "dataset": dataset.name, "cluster": cluster.name, "epochs": FLAGS.epochs, "whimpy": FLAGS.whimpy,
         "seed": FLAGS.seed, "runs": runs}
  paths = {name: common.output_path(FLAGS.out_dir, f"convergence.{ext}")
           for name, ext in (("json", "json"), ("csv", "csv"), ("plot", "png"))}
  common.write_json(paths["json"], doc)
  common.write_csv(paths["csv"], ["name", "system", "d", "time_s", "minibatches", "epochs", "test_accuracy",
                                  "train_loss"],
                   ([run["name"], run["system"], run["d"], t, mbs, mbs / epoch, acc, loss]
                    for run in runs for t, mbs, acc, loss in run["curve"]))
  plot(runs, epoch, paths["plot"], f"{model.name} on {dataset.name}; time: {time_axis}")

  horovod = next(r for r in runs if r["system"] == "horovod")
  print(f"{'run':28} {'GPUs':>4} {'time to ' + format(FLAGS.target_accuracy, '.0%'):>14} "
        f"{'final acc':>9} {'speedup vs Horovod':>18}")
  for run in runs:
    t, th = run["time_to_target_s"], horovod["time_to_target_s"]
    speed = f"{th / t:.2f}x ({(t - th) / th:+.0%} time)" if t and th else "-"
    print(f"{run['name']:28} {run['gpus']:>4} {t if t is not None else float('nan'):14.4g} "
          f"{run['final_test_accuracy']:9.4f} {speed:>18}")
  for run in runs:
    if "staleness" in run:
      s = run["staleness"]
      print(f"{run['name']}: local staleness {s['local_staleness']}, global {s['global_staleness']} "
            f"(bound {max(s['global_bound'])}), blocked {sum(s['blocked_seconds']):.4g} s")
  if horovod["time_to_target_s"] is None:
    print(f"the data-parallel baseline did not reach {FLAGS.target_accuracy:.0%} within {FLAGS.epochs} epochs "
          f"(final {horovod['final_test_accuracy']:.4f} at {horovod['curve'][-1][0]:.4g} s): no speedup to report")
  print(f"time axis: {time_axis} (emulated seconds, not wall time)")
  common.print_outputs(paths.items(), width=5)


def plot(runs: list[dict], epoch: float, path: str, title: str) -> None:
  plt = common.pyplot()
  fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.2))
  for run in runs:
    style = "--" if run["system"] != "hetpipe" else "-"
    ax_t.plot([c[0] for c in run["curve"]], [c[2] for c in run["curve"]], style, label=run["name"])
    ax_e.plot([c[1] / epoch for c in run["curve"]], [c[2] for c in run["curve"]], style, label=run["name"])
  ax_t.axhline(FLAGS.target_accuracy, color="grey", lw=0.8)
  ax_e.axhline(FLAGS.target_accuracy, color="grey", lw=0.8)
  ax_t.set(xlabel="emulated time (s)", ylabel="test accuracy")
  ax_e.set(xlabel="epochs", ylabel="test accuracy")
  for ax in (ax_t, ax_e):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


cli = common.console(main)

if __name__ == "__main__":
  cli()
