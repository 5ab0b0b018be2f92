r"""Auto-tuner: the fastest HetPipe configuration of a model on a cluster (:mod:`hetpipe_jax.tune`).

Searches the grouping of GPUs into virtual workers (NP, ED, HD and general groupings), each virtual
worker's GPU order, cuts and Nm (the same for all, the planner's max_fit, or sized to each one's speed),
D, the PS placement and the transfer models (serial, or overlapped with computation; a virtual worker's
push and pull whole, or staged: each stage's part on its own), with the planner and the ``sim`` executor.
Prints the best configurations with their predicted images/s and efficiency (over the ideal heterogeneous
aggregate), the best of every grouping, and writes ``tune.json`` (its ``best``
object is a configuration that ``experiments.train --plan=tune.json`` runs), a CSV of every simulated
configuration and a PNG::

  python -m experiments.tune
  python -m experiments.tune --model=resnet152 --cluster=paper_testbed
  python -m experiments.train --plan=outputs/tune/tune.json --executor=sim

--objective=time_to_accuracy ranks by the predicted time to the target accuracy instead: the images a run
needs grow with the mean staleness its simulated trace shows (:class:`hetpipe_jax.staleness.StalenessModel`),
fitted to real runs and validated by the convergence study, whose ``convergence.json`` it reads::

  python -m experiments.convergence
  python -m experiments.tune --objective=time_to_accuracy --staleness_model=outputs/convergence/convergence.json
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "vgg19", "Model: vgg19 or resnet152 (full size, simulated), or a small one (mlp, cnn, "
                    "vgg, resnet) profiled on --dataset.")
flags.DEFINE_string("dataset", "auto", "Dataset whose inputs a small model is profiled on.")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or .toml file.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size.")
flags.DEFINE_string("optimizer", "momentum", "Local optimizer (its state counts in memory): sgd, momentum, adam.")
flags.DEFINE_string("weight_mode", "stash", "stash or latest (memory and the run).")
flags.DEFINE_enum("objective", "throughput", ["throughput", "time_to_accuracy"], "What the best configuration "
                  "maximises: simulated images/s, or the inverse of the predicted time to accuracy.")
flags.DEFINE_string("staleness_model", "outputs/convergence/convergence.json", "time_to_accuracy: the "
                    "convergence study's JSON, whose staleness_model (images to target = images0 x (1 + beta x "
                    "mean staleness)) predicts time to accuracy.")
flags.DEFINE_integer("waves", 50, "Waves per virtual worker of the predicting runs (screening runs half).")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D searched.")
flags.DEFINE_list("transfers", ["serial", "overlap"], "Transfer models searched: serial (the input received "
                  "inside the task), overlap (received while the device computes).")
flags.DEFINE_list("ps_transfers", ["whole", "staged"], "PS transfer models searched: whole (a virtual worker's "
                  "push and pull move as one), staged (each stage's part moves on its own: train --staged_ps).")
flags.DEFINE_integer("nm_max", 32, "Largest Nm (minibatches per wave) tried per virtual worker.")
flags.DEFINE_bool("windows", True, "Nm sized to speed may exceed what a virtual worker's memory holds in flight "
                  "(up to --nm_max), with a window of the largest Nm that fits (--nowindows: Nm in flight).")
flags.DEFINE_integer("top", 10, "Configurations printed.")
flags.DEFINE_string("out_dir", "outputs/tune", "Where tune.json, tune.csv and tune.png go.")



def model_profiles(name: str, dataset_name: str, batch_size: int):
  """Unit profiles of a full-size model on its input, or of a small model on a dataset's inputs."""
  from hetpipe_jax import get_model, load_dataset
  from hetpipe_jax.cost.profile import full_size_profiles, profile_units
  from hetpipe_jax.models import FULL_SIZE
  if name in FULL_SIZE:
    return full_size_profiles(name, batch_size)
  import jax
  import jax.numpy as jnp
  dataset = load_dataset(dataset_name)
  return profile_units(get_model(name, dataset.num_classes),
                       jax.ShapeDtypeStruct((batch_size,) + dataset.x_train.shape[1:], jnp.float32))


def main(argv):
  del argv
  from hetpipe_jax import get_cluster
  from hetpipe_jax.tune import tune
  space = search_space()
  staleness_model = load_staleness_model(FLAGS.staleness_model) if FLAGS.objective == "time_to_accuracy" else None
  cluster = get_cluster(FLAGS.cluster)
  profiles = model_profiles(FLAGS.model, FLAGS.dataset, FLAGS.batch_size)
  out = tune(cluster, profiles, FLAGS.batch_size, space, tune_options(staleness_model))
  doc = tune_doc(out, staleness_model)
  outputs = write_outputs(doc)
  report(cluster, out, staleness_model)
  common.print_outputs(outputs, width=6)


def search_space():
  """The flags' search space (a bad value refused in one line)."""
  from hetpipe_jax.tune import SearchSpace
  ds = common.parse_ints("ds", FLAGS.ds)
  if not ds or any(d < 0 for d in ds):
    raise common.config_error(f"--ds={','.join(FLAGS.ds)}; give one or more clock distance bounds D >= 0")
  transfers = common.parse_choices("transfers", FLAGS.transfers, common.TRANSFERS)
  staged = common.parse_ps_transfers(FLAGS.ps_transfers)
  if FLAGS.nm_max < 1:
    raise common.config_error(f"--nm_max={FLAGS.nm_max}; try at least Nm = 1")
  return SearchSpace(ds=tuple(ds), transfers=tuple(transfers), staged=tuple(staged), nm_max=FLAGS.nm_max,
                     windows=FLAGS.windows)


def tune_options(staleness_model):
  """How the flags run the search: their waves and run setting, ranked by ``staleness_model`` if any."""
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.optim import optimizer_slots
  from hetpipe_jax.tune import RunSetting, TuneOptions
  setting = RunSetting(CostContext(FLAGS.weight_mode, optimizer_slots(FLAGS.optimizer)))
  return TuneOptions(waves=FLAGS.waves, staleness_model=staleness_model, setting=setting,
                     progress=lambda line: common.progress("%s", line))


def tune_doc(out, staleness_model) -> dict:
  """``tune.json``: the setting, the search's counts, the best configuration (which ``experiments.train
  --plan`` runs), the best of every grouping and every simulated one."""
  from hetpipe_jax import load_dataset
  from hetpipe_jax.models import FULL_SIZE
  from hetpipe_jax.tune import policy_rows, result_json
  best, results = out.best, out.results
  dataset = None if FLAGS.model in FULL_SIZE else load_dataset(FLAGS.dataset).name  # what it was profiled on
  setting = {"model": FLAGS.model, "dataset": dataset, "cluster": FLAGS.cluster, "batch_size": FLAGS.batch_size,
             "optimizer": FLAGS.optimizer, "weight_mode": FLAGS.weight_mode, "schedule": "1f1b",
             "waves": FLAGS.waves}
  doc = {**setting, "objective": FLAGS.objective, "ideal_images_per_sec": best.ideal_images_per_sec,
         "search_seconds": out.seconds, "planned": out.planned, "partitions": out.partitions,
         "simulated": len(results), "best": {**setting, **result_json(best, FLAGS.batch_size, staleness_model)},
         "groupings": {name: result_json(r, FLAGS.batch_size, staleness_model)
                       for name, r in policy_rows(results).items()},
         "results": [result_json(r, FLAGS.batch_size, staleness_model) for r in results]}
  if staleness_model is not None:
    doc["staleness_model"] = dataclasses.asdict(staleness_model)
  return doc


def write_outputs(doc: dict) -> list[tuple[str, str]]:
  """``tune.json``, a CSV of every simulated configuration and the chart: (kind, path) of each."""
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "tune.json"), doc)
  rows = doc["results"]
  csv_out = common.write_csv(common.output_path(FLAGS.out_dir, "tune.csv"),
                             ["grouping", "nm_rule", "nm", "d", "placement", "overlap_transfers", "staged_ps",
                              "images_per_sec",
                              "efficiency", "modelled_images_per_sec", "waves", "mean_staleness",
                              "time_to_accuracy_s"],
                             ([r["grouping"], r["nm_rule"], " ".join(map(str, r["nm"])), r["d"], r["placement"],
                               r["overlap_transfers"], r["staged_ps"], r["images_per_sec"], r["efficiency"],
                               r["modelled_images_per_sec"], r["waves"], r["mean_staleness"],
                               r.get("time_to_accuracy_s", "")] for r in rows))
  png_out = common.output_path(FLAGS.out_dir, "tune.png")
  chart(doc, png_out)
  return [("json", json_out), ("csv", csv_out), ("chart", png_out)]


def report(cluster, out, staleness_model) -> None:
  """Prints the best configurations, the best of every grouping and the search's cost."""
  from hetpipe_jax.tune import policy_rows
  best, results = out.best, out.results
  print(f"{FLAGS.model} on {cluster.name} ({cluster.num_gpus} GPUs), batch {FLAGS.batch_size}: "
        f"ideal aggregate {best.ideal_images_per_sec:.1f} images/s")
  if staleness_model is not None:
    print(f"ranked by predicted time to {staleness_model.target_accuracy:.0%}: {staleness_model.images0:.4g} x "
          f"(1 + {staleness_model.beta:.4g} x mean staleness) images (fitted in {FLAGS.staleness_model})")
  print(f"{'images/s':>9} {'eff.':>5} {'planned':>8} {'stale':>5} {'TTA s':>8}  configuration")
  for r in results[:FLAGS.top]:
    tta = "-" if staleness_model is None else f"{staleness_model.seconds(r.images_per_sec, r.staleness):.4g}"
    print(f"{r.images_per_sec:9.1f} {r.efficiency:5.2f} {r.candidate.modelled_images_per_sec(FLAGS.batch_size):8.1f}"
          f" {r.staleness:5.2f} {tta:>8}  {r.candidate.label}")
  print("best of every grouping:")
  for name, r in sorted(policy_rows(results).items(), key=lambda kv: -kv[1].images_per_sec):
    print(f"{r.images_per_sec:9.1f} {r.efficiency:5.2f}  {name}: {r.candidate.label}")
  print(f"searched {out.planned} planned configurations ({out.partitions} partitions), simulated "
        f"{len(results)} in {out.seconds:.1f} s (host); images/s of the simulated cluster, not measured on GPUs")
  print(f"best: {best.images_per_sec:.1f} images/s, efficiency {best.efficiency:.3f} ({best.candidate.label})")


def load_staleness_model(path: str):
  """The staleness model the convergence study fitted (its ``convergence.json``)."""
  import json

  from hetpipe_jax.staleness import StalenessModel
  try:
    with open(path, encoding="utf-8") as f:
      fit = json.load(f).get("staleness_model")
  except (OSError, ValueError) as e:
    raise common.config_error(f"--staleness_model={path}: cannot read it ({e}); run python -m "
                              "experiments.convergence first, or use --objective=throughput") from None
  if not isinstance(fit, dict) or not {"images0", "beta"} <= set(fit):
    raise common.config_error(f"--staleness_model={path} holds no fitted staleness_model; give the "
                              "convergence.json of python -m experiments.convergence (this version)")
  return StalenessModel(float(fit["images0"]), float(fit["beta"]), fit.get("target_accuracy"))


def chart(doc: dict, path: str) -> None:
  """The best simulated images/s of every grouping, with the ideal aggregate."""
  plt = common.pyplot()
  rows = sorted(doc["groupings"].items(), key=lambda kv: -kv[1]["images_per_sec"])
  fig, ax = plt.subplots(figsize=(8, 4.2))
  ax.bar(range(len(rows)), [r["images_per_sec"] for _, r in rows], color="#4C72B0")
  ax.axhline(doc["ideal_images_per_sec"], color="#C44E52", linestyle="--", linewidth=1)
  ax.text(len(rows) - 0.5, doc["ideal_images_per_sec"], f"ideal aggregate {doc['ideal_images_per_sec']:.0f}",
          ha="right", va="bottom", fontsize=7, color="#C44E52")
  ax.set_xticks(range(len(rows)))
  ax.set_xticklabels([f"{name}\nNm {r['nm']}" if len(r["nm"]) <= 4 else name for name, r in rows], fontsize=7)
  ax.set(title=f"{doc['model']} on {os.path.basename(doc['cluster'])}: best of every grouping (tuner)",
         ylabel="images/s (simulated)")
  ax.grid(alpha=0.3, axis="y")
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
