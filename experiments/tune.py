r"""Auto-tuner: the fastest configuration of a model on a cluster, HetPipe's or a peer's (:mod:`hetpipe_jax.tune`).

Searches the grouping of GPUs into virtual workers (NP, ED, HD and general groupings), each virtual
worker's GPU order, cuts and Nm (the same for all, the planner's max_fit, or sized to each one's speed),
D, the PS placement and the transfer models (serial, or overlapped with computation; a virtual worker's
push and pull whole, or staged: each stage's part on its own), with the planner and the ``sim`` executor;
and beside HetPipe the peers of --peers (:mod:`hetpipe_jax.baselines`), each over a small grid of its knobs
(:mod:`hetpipe_jax.tune.peers`: hetero_dp's global batch, sync_pipeline's policy and microbatches, local
SGD's H, H by speed and workers, Horovod's fusion buffer). Prints the best configurations with their
predicted images/s and efficiency (over the ideal heterogeneous aggregate), the best of every grouping and
of every peer, and writes ``tune.json`` (its ``best``, of any system, and ``best_hetpipe``, the best WSP
configuration, are what ``experiments.train --plan=tune.json [--plan_entry=best_hetpipe]`` runs), a CSV of
every simulated configuration (and one of the peers') and a PNG::

  python -m experiments.tune
  python -m experiments.tune --model=resnet152 --cluster=paper_testbed
  python -m experiments.train --plan=outputs/tune/tune.json --executor=sim
  python -m experiments.train --plan=outputs/tune/tune.json --plan_entry=best_hetpipe --executor=sim

The objective (--objective) is by default the predicted time to the target accuracy: for HetPipe the images a
run needs grow with the mean staleness its simulated trace shows (:class:`hetpipe_jax.staleness.StalenessModel`);
for a synchronous peer with its global batch (the critical batch size), for local SGD with its H
(:mod:`hetpipe_jax.tune.statistical`); both fitted to the real runs of the convergence study, whose
``convergence.json`` it reads. Without that file it ranks by images/s and says so in one line::

  python -m experiments.convergence
  python -m experiments.tune --staleness_model=outputs/convergence/convergence.json
  python -m experiments.tune --objective=throughput --peers=hetero_dp,sync_pipeline
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import flags

from experiments import common, run_flags, system_flags
from hetpipe_jax import ConfigError, get_cluster, load_dataset
from hetpipe_jax.core.controls import parse_control
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.models import FULL_SIZE
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.recompute import check_recompute
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.systems import get_system
from hetpipe_jax.tune import (
  HETPIPE,
  PeerResult,
  RunSetting,
  SearchSpace,
  TuneOptions,
  distinct_rows,
  fit_peer_accuracy,
  peer_result_json,
  policy_rows,
  result_json,
  tune,
)
from hetpipe_jax.tune.peers import small_profiles, tuner_profiles

FLAGS = flags.FLAGS
# The run settings the search takes (experiments.run_flags), at the tuner's defaults: the paper's testbed and VGG-19,
# momentum (for its memory); --waves: of the predicting runs (the screening runs take half).
run_flags.define(["model", "dataset", "cluster", "batch_size", "optimizer", "weight_mode", "staleness", "recompute",
                  "tp", "waves", "noise"],
                 overrides={"model": "vgg19", "cluster": "paper_testbed", "optimizer": "momentum"})
flags.adopt_module_key_flags(run_flags)  # --help lists them
flags.DEFINE_enum("objective", "time_to_accuracy", ["throughput", "time_to_accuracy"], "What the best "
                  "configuration maximises: simulated images/s, or the inverse of the predicted time to accuracy "
                  "(without --staleness_model's file and without this flag: images/s, said in one line).")
flags.DEFINE_string("staleness_model", "outputs/convergence/convergence.json", "time_to_accuracy: the "
                    "convergence study's JSON, whose staleness_model (images to target = images0 x (1 + beta x "
                    "mean staleness)) and peer runs (images to target against the global batch, or H) predict "
                    "time to accuracy.")
flags.DEFINE_list("peers", ["horovod", "hetero_dp", "sync_pipeline", "local_sgd"], "Peer systems searched beside "
                  "HetPipe, each over a grid of its knobs (empty: HetPipe alone).")
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



def model_profiles(name: str, dataset_name: str, batch_size: int, peers: bool = False):
  """Unit profiles of a full-size model on its input, or of a small model on a dataset's inputs; with
  ``peers``, at any batch size (a :class:`~hetpipe_jax.cost.batch.BatchProfiles`: the peers split batches)."""
  if peers:
    return tuner_profiles(name, dataset_name, batch_size)
  if name in FULL_SIZE:
    return full_size_profiles(name, batch_size)
  return small_profiles(name, dataset_name, batch_size)


@dataclasses.dataclass(frozen=True)
class TuneRequest:
  """What the flags ask of the tuner (:func:`flags_to_request`): the run setting, the search space, the objective
  and the outputs."""

  model: str
  dataset: str
  cluster: str
  batch_size: int
  optimizer: str
  weight_mode: str
  recompute: str
  waves: int
  space: SearchSpace
  staleness: str  # HetPipe's staleness control (its memory charge: the Nm that fits)
  objective: str  # throughput or time_to_accuracy
  objective_given: bool  # --objective given on the command line (then a missing fit is an error)
  staleness_model: str  # the convergence.json of time_to_accuracy
  top: int
  out_dir: str

  @property
  def setting(self) -> dict[str, Any]:
    """The run setting as tune.json records it (``dataset``: what a small model was profiled on)."""
    dataset = None if self.model in FULL_SIZE else load_dataset(self.dataset).name
    return {"model": self.model, "dataset": dataset, "cluster": self.cluster, "batch_size": self.batch_size,
            "optimizer": self.optimizer, "weight_mode": self.weight_mode, "staleness": self.staleness,
            "recompute": self.recompute,
            "schedule": "1f1b", "waves": self.waves,
            **({"noise": self.space.noise} if self.space.noise != "none" else {})}  # (what it was tuned under)


def main(argv):
  del argv
  system_flags.import_from_flags(FLAGS)
  request = flags_to_request()
  staleness_model, peer_accuracy, note = objective_models(request)
  if note:
    print(note, flush=True)
  cluster = get_cluster(request.cluster)
  profiles = model_profiles(request.model, request.dataset, request.batch_size, peers=bool(request.space.peers))
  out = tune(cluster, profiles, request.batch_size, request.space, tune_options(request, staleness_model,
                                                                                  peer_accuracy))
  doc = tune_doc(request, out, staleness_model, note)
  outputs = write_outputs(doc, request.out_dir)
  report(request, cluster, out, staleness_model)
  common.print_outputs(outputs, width=6)


def flags_to_request() -> TuneRequest:
  """The flags as a :class:`TuneRequest` (a bad value refused in one line)."""
  if FLAGS.top < 1:
    raise common.config_error(f"--top={FLAGS.top}; give how many configurations to print, >= 1")
  try:
    parse_control(FLAGS.staleness)
  except ConfigError as e:
    raise common.config_error(str(e)) from None
  return TuneRequest(FLAGS.model, FLAGS.dataset, FLAGS.cluster, FLAGS.batch_size, FLAGS.optimizer,
                     FLAGS.weight_mode, check_recompute(FLAGS.recompute), FLAGS.waves, search_space(), FLAGS.staleness,
                     FLAGS.objective, bool(FLAGS["objective"].present), FLAGS.staleness_model, FLAGS.top,
                     FLAGS.out_dir)


def search_space() -> SearchSpace:
  """The flags' search space (a bad value refused in one line)."""
  ds = common.parse_ints("ds", FLAGS.ds)
  if not ds or any(d < 0 for d in ds):
    raise common.config_error(f"--ds={','.join(FLAGS.ds)}; give one or more clock distance bounds D >= 0")
  transfers = common.parse_choices("transfers", FLAGS.transfers, common.TRANSFERS)
  staged = common.parse_ps_transfers(FLAGS.ps_transfers)
  if FLAGS.nm_max < 1:
    raise common.config_error(f"--nm_max={FLAGS.nm_max}; try at least Nm = 1")
  peers = tuple(dict.fromkeys(p for p in FLAGS.peers if p))
  for name in peers:
    try:
      get_system(name)
    except ConfigError as e:
      raise common.config_error(f"--peers={','.join(FLAGS.peers)}: {e}") from None
  return SearchSpace(ds=tuple(ds), transfers=tuple(transfers), staged=tuple(staged), nm_max=FLAGS.nm_max,
                     windows=FLAGS.windows, peers=peers, tp=parse_tp(FLAGS.tp), noise=FLAGS.noise)


def tune_options(request: TuneRequest, staleness_model, peer_accuracy=None) -> TuneOptions:
  """How the search runs: the request's waves and run setting, ranked by ``staleness_model`` (HetPipe) and
  ``peer_accuracy`` (the peers) if any."""
  setting = RunSetting(CostContext(request.weight_mode, optimizer_slots(request.optimizer),
                                   recompute=request.recompute, control=parse_control(request.staleness)))
  return TuneOptions(waves=request.waves, staleness_model=staleness_model, peer_accuracy=peer_accuracy,
                     setting=setting, progress=lambda line: common.progress("%s", line))


def tune_doc(request: TuneRequest, out, staleness_model, note: str | None = None) -> dict:
  """``tune.json``: the setting, the search's counts, the best configuration of any system (``best``: which
  ``experiments.train --plan`` runs) and the best HetPipe one (``best_hetpipe``), the best of every grouping
  and of every peer, and every simulated one."""
  best, results, accuracy, batch = out.best, out.results, out.peer_accuracy, request.batch_size
  setting = request.setting
  best_hetpipe = {**setting, "system": HETPIPE, **result_json(best, batch, staleness_model)}
  overall = out.overall
  doc = {**setting, "objective": "throughput" if staleness_model is None else "time_to_accuracy",
         "ideal_images_per_sec": best.ideal_images_per_sec, "search_seconds": out.seconds, "planned": out.planned,
         "partitions": out.partitions, "simulated": len(results),
         "best": ({**setting, **peer_result_json(overall, accuracy)} if isinstance(overall, PeerResult)
                  else best_hetpipe),
         "best_hetpipe": best_hetpipe,
         "groupings": {name: result_json(r, batch, staleness_model) for name, r in policy_rows(results).items()},
         "results": [result_json(r, batch, staleness_model) for r in results],
         "peers_best": {name: peer_result_json(p, accuracy) for name, p in out.best_peers().items()},
         "peers": [peer_result_json(p, accuracy) for p in out.peers],
         "peers_skipped": [{"system": s.system, **s.knobs._asdict(), "reason": s.reason} for s in out.peers_skipped]}
  if note:
    doc["objective_note"] = note
  if staleness_model is not None:
    doc["staleness_model"] = dataclasses.asdict(staleness_model)
  if accuracy is not None:
    doc["peer_accuracy"] = accuracy.to_json()
  return doc


def write_outputs(doc: dict, out_dir: str) -> list[tuple[str, str]]:
  """``tune.json``, a CSV of every simulated configuration (and of the peers' settings) and the chart in
  ``out_dir``: (kind, path) of each."""
  json_out = common.write_json(common.output_path(out_dir, "tune.json"), doc)
  rows = doc["results"]
  csv_out = common.write_csv(common.output_path(out_dir, "tune.csv"),
                             ["grouping", "nm_rule", "nm", "d", "placement", "overlap_transfers", "staged_ps",
                              "images_per_sec",
                              "efficiency", "modelled_images_per_sec", "waves", "mean_staleness",
                              "time_to_accuracy_s"],
                             ([r["grouping"], r["nm_rule"], " ".join(map(str, r["nm"])), r["d"], r["placement"],
                               r["overlap_transfers"], r["staged_ps"], r["images_per_sec"], r["efficiency"],
                               r["modelled_images_per_sec"], r["waves"], r["mean_staleness"],
                               r.get("time_to_accuracy_s", "")] for r in rows))
  outputs = [("json", json_out), ("csv", csv_out)]
  if doc["peers"]:
    keys = ["system", "fusion_mb", "global_batch", "microbatches", "policy", "local_steps", "h_by_speed",
            "local_workers", "images_per_sec", "efficiency", "examples_per_update", "round_seconds",
            "images_to_target", "time_to_accuracy_s"]
    outputs.append(("peers", common.write_csv(common.output_path(out_dir, "tune_peers.csv"), keys,
                                              ([p.get(k, "") for k in keys] for p in doc["peers"]))))
  png_out = common.output_path(out_dir, "tune.png")
  chart(doc, png_out)
  return outputs + [("chart", png_out)]


COLUMNS = (
    "images/s: examples per second of the configuration on the sim executor (the simulated cluster)",
    "eff.: images/s over the ideal aggregate (the sum of every GPU's standalone rate on the model)",
    "planned: the planner's modelled images/s of the same plan (batch x sum Nm x the slowest wave rate), before "
    "simulation",
    "stale: the mean staleness of the simulated trace (hetpipe_jax.staleness.mean_staleness)",
    "TTA s: predicted seconds to the target accuracy (staleness model's images / images/s; -: ranked by images/s)",
    "configuration: grouping, Nm rule and Nm per virtual worker (window: most in flight), D, PS placement, "
    "transfer models",
)


def _seconds(value: float | None) -> str:
  return "-" if value is None else ("never" if value == float("inf") else f"{value:.4g}")


def report(request: TuneRequest, cluster, out, staleness_model) -> None:
  """Prints the best configurations, the best of every grouping and of every peer, and the search's cost."""
  best, results, accuracy = out.best, out.results, out.peer_accuracy
  print(f"{request.model} on {cluster.name} ({cluster.num_gpus} GPUs), batch {request.batch_size}: "
        f"ideal aggregate {best.ideal_images_per_sec:.1f} images/s")
  if staleness_model is not None:
    print(f"ranked by predicted time to {staleness_model.target_accuracy:.0%}: {staleness_model.images0:.4g} x "
          f"(1 + {staleness_model.beta:.4g} x mean staleness) images (fitted in {request.staleness_model})")
  rows = distinct_rows(results, request.top)
  print(f"the best {len(rows)} distinct configurations (configurations that differ only in D and ran the same, "
        "their gate never closed, share a row):")
  print(f"{'images/s':>9} {'eff.':>5} {'planned':>8} {'stale':>5} {'TTA s':>8}  configuration")
  for row in rows:
    r = row.first
    tta = None if staleness_model is None else staleness_model.seconds(r.images_per_sec, r.staleness)
    print(f"{r.images_per_sec:9.1f} {r.efficiency:5.2f} {r.candidate.modelled_images_per_sec(request.batch_size):8.1f}"
          f" {r.staleness:5.2f} {_seconds(tta):>8}  {row.label}")
  for line in COLUMNS:
    print(f"  {line}")
  print("best of every grouping:")
  for name, r in sorted(policy_rows(results).items(), key=lambda kv: -kv[1].images_per_sec):
    print(f"{r.images_per_sec:9.1f} {r.efficiency:5.2f}  {name}: {r.candidate.label}")
  if out.peers or out.peers_skipped:
    print(f"peers, the best setting of each ({len(out.peers)} settings simulated):")
    print(f"{'images/s':>9} {'eff.':>5} {'TTA s':>8}  setting")
    for p in out.best_peers().values():
      tta = None if accuracy is None else accuracy.seconds(p)
      print(f"{p.images_per_sec:9.1f} {p.efficiency:5.2f} {_seconds(tta):>8}  {p.label}")
    print("  TTA s here: the peer's predicted images to target (its kind's fit, hetpipe_jax.tune.statistical) over "
          "its images/s; never: its kind's runs all missed the target")
    for system in dict.fromkeys(s.system for s in out.peers_skipped):
      mine = [s for s in out.peers_skipped if s.system == system]
      print(f"  {system}: {len(mine)} settings cannot run here (e.g. {mine[0].reason})")
    for line in ([] if accuracy is None else accuracy.lines()):
      print(f"  peers' images to target: {line}")
  print(f"searched {out.planned} planned configurations ({out.partitions} partitions), simulated "
        f"{len(results)} in {out.seconds:.1f} s (host); images/s of the simulated cluster, not measured on GPUs")
  overall = out.overall
  hetpipe = f"{best.images_per_sec:.1f} images/s, efficiency {best.efficiency:.3f} ({best.candidate.label})"
  if isinstance(overall, PeerResult):
    print(f"best HetPipe: {hetpipe}")
    print(f"best: {overall.system}, {overall.images_per_sec:.1f} images/s, efficiency {overall.efficiency:.3f} "
          f"({overall.label})")
  else:
    print(f"best: hetpipe, {hetpipe}")


def objective_models(request: TuneRequest):
  """(the staleness model, the peers' accuracy model, a line to print or None) of the objective the flags ask
  for: (None, None, None) for images/s; time to accuracy without --staleness_model's file (or with one that
  holds no fit) falls back to images/s with a line saying why, unless --objective asks for it explicitly.

  Raises:
    ConfigError: for an unreadable file, or (--objective given) a missing one or one without a fit.
  """
  if request.objective == "throughput":
    return None, None, None
  path = request.staleness_model
  fallback = ("objective: time to accuracy needs the convergence study's {}; ranking by images/s (throughput) "
              "instead: make it with python -m experiments.convergence (or give --objective=throughput)")
  if not os.path.exists(path) and not request.objective_given:
    return None, None, fallback.format(f"{path}, which is missing")
  doc = read_convergence(path)
  try:
    staleness_model = staleness_from(doc, path)
  except ConfigError:
    if request.objective_given:
      raise
    return None, None, fallback.format(f"fitted staleness model, which {path} does not hold "
                                       f"({doc.get('staleness_note', 'no staleness_model')})")
  runs = doc.get("runs")
  runs = [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
  return staleness_model, fit_peer_accuracy(runs, staleness_model, doc.get("target_accuracy")), None


def read_convergence(path: str) -> dict:
  """The convergence study's ``convergence.json``.

  Raises:
    ConfigError: when it cannot be read.
  """
  try:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:
    raise common.config_error(f"--staleness_model={path}: cannot read it ({e}); run python -m "
                              "experiments.convergence first, or use --objective=throughput") from None
  if not isinstance(doc, dict):
    raise common.config_error(f"--staleness_model={path} is not a convergence.json (not an object); give the one "
                              "python -m experiments.convergence writes")
  return doc


def staleness_from(doc: dict, path: str):
  """The staleness model the convergence study fitted (its ``convergence.json``'s ``staleness_model``).

  Raises:
    ConfigError: when it holds none.
  """
  fit = doc.get("staleness_model")
  if not isinstance(fit, dict) or not {"images0", "beta"} <= set(fit):
    raise common.config_error(f"--staleness_model={path} holds no fitted staleness_model; give the "
                              "convergence.json of python -m experiments.convergence (this version)")
  return StalenessModel(float(fit["images0"]), float(fit["beta"]), fit.get("target_accuracy"))


def load_staleness_model(path: str):
  """The staleness model the convergence study fitted (its ``convergence.json``)."""
  return staleness_from(read_convergence(path), path)


def chart(doc: dict, path: str) -> None:
  """The best simulated images/s of every grouping and of every peer, with the ideal aggregate."""
  plt = common.pyplot()
  rows = sorted(doc["groupings"].items(), key=lambda kv: -kv[1]["images_per_sec"])
  peers = sorted(doc.get("peers_best", {}).items(), key=lambda kv: -kv[1]["images_per_sec"])
  labels = [f"{name}\nNm {r['nm']}" if len(r["nm"]) <= 4 else name for name, r in rows] + [name for name, _ in peers]
  values = [r["images_per_sec"] for _, r in rows] + [p["images_per_sec"] for _, p in peers]
  fig, ax = plt.subplots(figsize=(8 + 0.5 * len(peers), 4.2))
  ax.bar(range(len(values)), values, color=["#4C72B0"] * len(rows) + ["#8C8C8C"] * len(peers))
  ax.axhline(doc["ideal_images_per_sec"], color="#C44E52", linestyle="--", linewidth=1)
  ax.text(len(values) - 0.5, doc["ideal_images_per_sec"], f"ideal aggregate {doc['ideal_images_per_sec']:.0f}",
          ha="right", va="bottom", fontsize=7, color="#C44E52")
  ax.set_xticks(range(len(values)))
  ax.set_xticklabels(labels, fontsize=7)
  what = "best of every grouping" + (" (blue) and peer (grey)" if peers else "")
  ax.set(title=f"{doc['model']} on {os.path.basename(doc['cluster'])}: {what} (tuner)", ylabel="images/s (simulated)")
  ax.grid(alpha=0.3, axis="y")
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
