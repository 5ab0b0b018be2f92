r"""Train a model with HetPipe on an emulated heterogeneous cluster.

Runs with no flags on embedded defaults: a small CNN on Fashion-MNIST (digits when it is not installed),
3 virtual workers of 2 stages each on the 4-speed-class ``hetero4`` cluster, Nm = 2, D = 1, the
deterministic ``virtual`` executor. Writes the trace, the metrics (JSON Lines), a summary and a PNG of
loss and accuracy against time, a Gantt chart of the first waves and a Chrome/Perfetto trace, checks the
trace against the WSP guarantees, and prints the paths::

  python -m experiments.train
  python -m experiments.train --num_vws=3 --stages=2 --nm=3 --d=1 --waves=6 --executor=wall \
      --trace_out=t.jsonl
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "Model: mlp, cnn, vgg, resnet.")
flags.DEFINE_string("dataset", "auto", "Dataset: auto (Fashion-MNIST, else digits), fashion_mnist, "
                    "digits, synthetic.")
flags.DEFINE_string("cluster", "hetero4", "Cluster preset (hetero4, hetero4x4, uniform8, paper_testbed, "
                    "paper_half, paper_mini, v100_t4) or a .toml file.")
flags.DEFINE_string("policy", None, "Allocation policy NP, ED or HD (or a grouping '0,1;2,3'): the planner "
                    "then decides virtual workers, device order, cuts and Nm (--nm=max_fit|best|N).")
flags.DEFINE_string("placement", "default", "PS shard placement of a planned run: default or local.")
flags.DEFINE_integer("num_vws", 3, "Number of virtual workers N.")
flags.DEFINE_list("stages", ["2"], "Devices (stages) per virtual worker: one value, or one per VW.")
flags.DEFINE_list("nm", ["2"], "Minibatches in flight per virtual worker (Nm >= 1): one, or one per VW; "
                  "with --policy also max_fit or best (default then: max_fit).")
flags.DEFINE_integer("d", 1, "Clock distance bound D >= 0.")
flags.DEFINE_integer("waves", 120, "Waves each virtual worker runs.")
flags.DEFINE_integer("batch_size", 32, "Examples per minibatch.")
flags.DEFINE_float("learning_rate", 0.05, "Local optimizer learning rate.")
flags.DEFINE_string("optimizer", "sgd", "Local optimizer: sgd, momentum, adam.")
flags.DEFINE_string("weight_mode", "stash", "stash (backward uses its forward's weights) or latest.")
flags.DEFINE_string("schedule", "1f1b", "Device task order: 1f1b (backward first) or fifo.")
flags.DEFINE_string("executor", "virtual", "virtual (emulated cluster clock, deterministic), wall, or sim "
                    "(cost model with shared links, no numerics).")
flags.DEFINE_float("time_scale", 0.0, "wall executor: pad every task to its emulated duration x this "
                   "(0: no padding).")
flags.DEFINE_string("cuts", None, "Unit boundaries per VW, ';'-separated, e.g. '0,2,5;0,3,5' "
                    "(default: stages as even as possible).")
flags.DEFINE_integer("seed", 0, "Initialisation and shuffling seed.")
flags.DEFINE_integer("eval_every", 10, "Evaluate test accuracy every this many global clock ticks.")
flags.DEFINE_bool("drop_remainder", False, "Drop the examples of an epoch that do not fill a minibatch.")
flags.DEFINE_string("out_dir", "outputs/train", "Directory for every output.")
flags.DEFINE_string("trace_out", None, "Trace path (default: OUT_DIR/trace.jsonl).")
flags.DEFINE_string("metrics_out", None, "Metrics path (default: OUT_DIR/metrics.jsonl).")


def _ints(name: str, values: list[str]) -> list[int]:
  from hetpipe_jax import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ConfigError(f"--{name}={','.join(values)} must be integers, e.g. --{name}=2 or "
                      f"--{name}=2,4") from None


def plot_training(metrics: list[dict], path: str, title: str) -> None:
  """Train loss per virtual worker and test accuracy of the global weights against time."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  for vw in sorted({r["vw"] for r in metrics}):
    rows = [r for r in metrics if r["vw"] == vw]
    ax_loss.plot([r["time"] for r in rows], [r["train_loss"] for r in rows], label=f"VW {vw}", lw=1)
  evals = [r for r in metrics if "test_accuracy" in r]
  ax_acc.plot([r["time"] for r in evals], [r["test_accuracy"] for r in evals], "o-", color="k")
  for ax, label in ((ax_loss, "train loss (per wave)"), (ax_acc, "test accuracy (global weights)")):
    ax.set_xlabel("time (s, executor clock)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_loss.legend()
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  from hetpipe_jax import ConfigError, ensure_cpu_devices, get_cluster  # pylint: disable=g-import-not-at-top
  from hetpipe_jax.plan.allocation import parse_policy  # pylint: disable=g-import-not-at-top
  policy = parse_policy(FLAGS.policy) if FLAGS.policy else None
  stages = _ints("stages", FLAGS.stages)
  if policy is not None:
    given = [f"--{name}" for name in ("num_vws", "stages", "cuts") if FLAGS[name].present]
    if given:
      raise ConfigError(f"--policy={FLAGS.policy} lets the planner choose the virtual workers, their stages "
                        f"and cuts; drop {', '.join(given)}")
    if len(FLAGS.nm) > 1:
      raise ConfigError(f"--nm={','.join(FLAGS.nm)} gives one Nm per virtual worker, but with --policy the "
                        "planner decides the virtual workers; give one value: a number, max_fit or best")
    nm = FLAGS.nm[0] if FLAGS["nm"].present else "max_fit"
    nms = [nm] if nm in ("max_fit", "best") else _ints("nm", FLAGS.nm)
    ensure_cpu_devices(max(8, get_cluster(FLAGS.cluster).num_gpus))
  else:
    nms = _ints("nm", FLAGS.nm)
    ensure_cpu_devices(max(8, FLAGS.num_vws * max(stages)))

  from hetpipe_jax import (RunConfig, check_trace, get_model, load_dataset,  # pylint: disable=g-import-not-at-top
                           run_hetpipe, staleness_stats)
  from hetpipe_jax.viz.timeline import chrome_trace, plot_gantt  # pylint: disable=g-import-not-at-top
  cuts = None
  if FLAGS.cuts:
    cuts = [_ints("cuts", c.split(",")) for c in FLAGS.cuts.split(";")]
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  trace_out = FLAGS.trace_out or os.path.join(FLAGS.out_dir, "trace.jsonl")
  metrics_out = FLAGS.metrics_out or os.path.join(FLAGS.out_dir, "metrics.jsonl")
  for path in (trace_out, metrics_out):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  config = RunConfig(
      cluster=FLAGS.cluster, num_vws=FLAGS.num_vws, stages=stages[0] if len(stages) == 1 else stages,
      nm=nms[0] if len(nms) == 1 else nms, d=FLAGS.d, waves=FLAGS.waves, batch_size=FLAGS.batch_size,
      optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate, weight_mode=FLAGS.weight_mode,
      schedule=FLAGS.schedule, executor=FLAGS.executor, time_scale=FLAGS.time_scale, cuts=cuts,
      seed=FLAGS.seed, eval_every=FLAGS.eval_every, drop_remainder=FLAGS.drop_remainder,
      trace_path=trace_out, policy=policy, placement=FLAGS.placement)
  dataset = load_dataset(FLAGS.dataset)
  model = get_model(FLAGS.model, dataset.num_classes)
  logging.info("training %s on %s: %s", model.name, dataset.name, config)
  result = run_hetpipe(model, dataset, config)
  meta = result.events[0]
  stages, nms = meta["stages"], meta["nm"]
  for i, (group, cut) in enumerate(zip(meta["gpus"], meta["cuts"])):
    logging.info("virtual worker %d: Nm=%d, GPUs %s, cuts %s", i, nms[i], group, cut)

  with open(metrics_out, "w", encoding="utf-8") as f:
    for row in result.metrics:
      f.write(json.dumps(row) + "\n")
  violations = check_trace(result.events)
  stats = staleness_stats(result.events)
  final_acc = result.metrics[-1].get("test_accuracy")  # None for the sim executor (no numerics)
  summary = {
      "model": model.name, "dataset": dataset.name, "cluster": config.cluster,
      "executor": config.executor, "num_vws": len(stages), "stages": stages, "nm": nms, "d": config.d,
      "policy": FLAGS.policy, "placement": FLAGS.placement, "gpus": meta["gpus"],
      "cuts": result.cuts, "waves": config.waves, "batch_size": config.batch_size,
      "seconds": result.seconds, "host_seconds": result.wall_seconds,
      "images_per_second": result.images_per_second, "final_test_accuracy": final_acc,
      "trace_violations": [str(v) for v in violations[:20]], "staleness": stats,
  }
  summary_out = os.path.join(FLAGS.out_dir, "summary.json")
  with open(summary_out, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  clock = {"virtual": "emulated cluster time", "sim": "simulated cluster time",
           "wall": "wall time (CPU emulation)"}[config.executor]
  outputs = [("trace", trace_out), ("metrics", metrics_out), ("summary", summary_out)]
  if final_acc is not None:
    outputs.append(("plot", os.path.join(FLAGS.out_dir, "training.png")))
    plot_training(result.metrics, outputs[-1][1],
                  f"{model.name} on {dataset.name}, {len(stages)} VWs x {stages} stages, Nm={nms}, "
                  f"D={config.d}, {config.executor} executor ({clock})")

  gantt_out = os.path.join(FLAGS.out_dir, "timeline.png")
  chrome_out = os.path.join(FLAGS.out_dir, "timeline.chrome.json")
  plot_gantt(result.events, gantt_out, waves=3)
  with open(chrome_out, "w", encoding="utf-8") as f:
    json.dump(chrome_trace(result.events), f)

  accuracy = "no numerics (sim)" if final_acc is None else f"final test accuracy {final_acc:.4f}"
  print(f"{accuracy} after {config.waves} waves per virtual worker; "
        f"{result.images_per_second:,.0f} images/s on the {clock} ({result.seconds:.4g} s; host "
        f"{result.wall_seconds:.1f} s)")
  print(f"observed staleness: local max {max(stats['local_staleness'])} (bound "
        f"{max(stats['local_bound'])}), global max {stats['max_global_staleness']} (bound "
        f"{max(stats['global_bound'])}); blocked at the gate "
        f"{', '.join(f'{s:.3g}' for s in stats['blocked_seconds'])} s per VW")
  print("trace check: " + ("OK, every WSP guarantee holds" if not violations else
                           f"FAILED, {len(violations)} violations (see {summary_out})"))
  for name, path in outputs + [("timeline", gantt_out), ("chrome", chrome_out)]:
    print(f"{name:8s} {os.path.abspath(path)}")
  if violations:
    raise SystemExit(1)


if __name__ == "__main__":
  from hetpipe_jax.errors import exit_on_config_error  # pylint: disable=g-import-not-at-top
  app.run(exit_on_config_error(main))
