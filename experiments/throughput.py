r"""The throughput study on the simulated cluster: HetPipe against its peers, one table per model, goodput first.

Defaults reproduce the paper's setting: the 16-GPU ``paper_testbed``, VGG-19 and ResNet-152 at 224x224,
batch 32 (a GPT model: --gpt_batch_size), momentum SGD (for memory), weight stashing. For each model, one
table (``table`` in throughput.json, throughput.csv, throughput_table.png) with the rows

* the peers of --systems (:mod:`hetpipe_jax.systems`, and those --systems_module registers), simulated on the same
  network, cost model and memory model: ``horovod``, ``hetero_dp``, ``sync_pipeline``, ``local_sgd``
  (their knobs: experiments.peer_flags, --h_by_speed on and --microbatches=0 the cluster's GPUs, as
  ``experiments.convergence`` sets them);
* ``HetPipe NP D=d``, ``HetPipe ED D=d``, ``HetPipe HD D=d`` for every d of --ds: the planner's partitions
  and Nm (max_fit), default placement, on the ``sim`` executor; and for every other Nm rule of --nms (best,
  speed: waves sized to each virtual worker's speed) ``HetPipe NP speed D=d`` and so on, marked by the
  convergence runs of ``HetPipe NP D=d`` that trained the same configuration (a convergence study names its rows
  at any --nm so);
* ``HetPipe tuned``: the tuner's best (``experiments.tune``'s search) by --tuned_objective: predicted time to
  accuracy with the staleness model of the matching convergence.json (its ``staleness_model``), else by
  images/s (the row says which); ``HetPipe tuned for images/s``: the tuner's best by images/s;
  ``HetPipe tuned + outer``: the configuration of ``HetPipe tuned`` with an outer optimizer at the parameter
  server, whose images/s are the same (the outer step changes no timing);

and the columns images/s (tokens/s for a GPT: tokens per sequence x sequences/s), efficiency against the
ideal heterogeneous aggregate of the cluster, the ratio to the best peer's images/s, and the goodput mark:
whether the row's training reached the target in the convergence study (--convergence: convergence.json
files whose time model is the row's model and whose cluster is the study's; matched by ``row``): "reaches"
(every seed), "misses" (some seed did not), "not trained" (no entry). A peer that cannot run on the cluster
(no GPU holds the model, ...) shows why instead of a number. The headline, printed last, is the fastest row
that reaches the target (without matching convergence data: the fastest row, its goodput unknown).

Sub-studies kept from the paper's study, outside the table (``rows`` in throughput.json, throughput_rows.csv,
charts): (a) ``nm``: one virtual worker as Nm grows, for several GPU mixes; (b) ``closed_form``: the
closed-form Horovod estimate on the GPUs that hold the model, its all-reduce after the backward pass;
(c) ``whimpy``: HetPipe (ED, local; every rule of --nms) on the GPUs that are not --whimpy vs. all, and that Horovod
estimate.
Row fields: {"model", "study", "config", "gpus", "nm", "d", "transfers", "images_per_sec",
"ideal_images_per_sec", "efficiency"}.

throughput.json: {"cluster", "tuned_objective", "convergence": the files read, "models": {model: {"unit",
"per_example", "batch_size", "ideal_images_per_sec", "best_peer", "convergence": the files that matched,
"table": [entries], "headline": {...}}}, "rows": [sub-study rows]}. A table entry: {"model", "row", "system",
"config", "objective", "gpus", "images_per_sec" (examples/s), "throughput" (``unit``/s), "unit",
"ideal_images_per_sec", "efficiency", "mfu" (model flops utilisation: the model's flops per example x
examples/s over the fp32 peak of every GPU of the cluster), "ratio_to_best_peer", "goodput", "time_to_target_s",
"reason"}; a model's "breakdowns": per system, its fastest row and where its GPUs' time went, the mean share of
each category (hetpipe_jax.studies.throughput_breakdown)::

  python -m experiments.throughput
  python -m experiments.throughput --cluster=mixed64 --models=resnet152,gpt2-xl
  python -m experiments.throughput --models=vgg19 --convergence=outputs/convergence/convergence.json
  python -m experiments.throughput --models=vgg19 --nms=max_fit,speed
"""

from __future__ import annotations

import os

from absl import flags
from matplotlib.patches import Patch

from experiments import common, peer_flags, run_flags, system_flags
from hetpipe_jax import get_cluster
from hetpipe_jax.studies.throughput import run_throughput
from hetpipe_jax.studies.throughput_goodput import MISSES, NOT_TRAINED, REACHES, convergence_docs
from hetpipe_jax.studies.throughput_records import (
  PEERS,
  SUB_STUDIES,
  ModelTable,
  SubStudyRow,
  ThroughputConfig,
  describe,
  is_peer,
)

FLAGS = flags.FLAGS
# The run settings the study takes (experiments.run_flags), at the study's defaults: the paper's setting, momentum
# SGD for memory; --batch_size is the image models' (a GPT model's: --gpt_batch_size), --optimizer only for memory,
# --overlap_transfers the HetPipe policy rows'.
run_flags.define(["cluster", "batch_size", "seq_len", "waves", "optimizer", "overlap_transfers", "recompute"],
                 overrides={"cluster": "paper_testbed", "batch_size": 32, "seq_len": None, "waves": 100,
                            "optimizer": "momentum", "overlap_transfers": False})
flags.adopt_module_key_flags(run_flags)  # --help lists them
flags.DEFINE_list("models", ["vgg19", "resnet152"], "Models to study: full-size ones (vgg19, resnet152, gpt2-xl, ...) "
                  "or small ones (mlp, cnn, vgg, resnet, gpt).")
flags.DEFINE_integer("gpt_batch_size", 8, "Minibatch size of a GPT model (sequences; 0: --batch_size).")
flags.DEFINE_integer("nm_max", 8, "Largest Nm in the single-virtual-worker sweep.")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D of the HetPipe rows and the tuner.")
flags.DEFINE_list("nms", ["max_fit"], "Nm rules of the HetPipe policy rows: max_fit (rows 'HetPipe NP D=0'), best, "
                  "speed (waves sized to each virtual worker's speed: rows 'HetPipe NP speed D=0').")
flags.DEFINE_list("tune_ds", None, "D values the tuner searches (default: --ds); fewer keep it quicker on large "
                  "clusters.")
flags.DEFINE_list("sub_studies", list(SUB_STUDIES), "Sub-studies outside the table: nm, closed_form, whimpy "
                  "(empty: none).")
flags.DEFINE_string("whimpy", "RTX 2060", "GPU type left out of one side of the whimpy sub-study.")
flags.DEFINE_string("out_dir", "outputs/throughput", "Where the JSON, CSV and charts go.")
flags.DEFINE_bool("tuned", True, "Add the tuned rows (experiments.tune's search).")
flags.DEFINE_integer("max_stages", 0, "Most stages per virtual worker the tuner tries (0: no limit; a convergence "
                     "study of a small model limits them to its units, e.g. 4 for the MLP).")
flags.DEFINE_enum("tuned_objective", "time_to_accuracy", ["time_to_accuracy", "throughput"],
                  "What the 'HetPipe tuned' row optimises: predicted time to accuracy (the staleness model of the "
                  "matching --convergence file; images/s when there is none), or images/s.")
flags.DEFINE_list("systems", list(PEERS), "Peer systems of the table "
                  "(hetpipe_jax.systems, and those --systems_module registers).")
peer_flags.override_defaults(h_by_speed=True)  # the study's one default of its own (experiments.peer_flags)
flags.DEFINE_list("convergence", None, "convergence.json files (experiments.convergence) giving each row's goodput "
                  "mark; default: outputs/convergence/convergence.json if it exists; empty: none.")

DEFAULT_CONVERGENCE = os.path.join("outputs", "convergence", "convergence.json")


def table_chart(studies: list[ModelTable], path: str) -> str:
  """One bar chart per model: peers and HetPipe rows coloured apart, rows that miss the target hatched and
  marked, rows that cannot run named, the ideal aggregate as a line."""
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(studies), figsize=(7 * len(studies), 5), squeeze=False)
  for ax, s in zip(axes[0], studies):
    values = [e.throughput or 0.0 for e in s.table]
    colours = ["#999999" if is_peer(e) else "#4C72B0" for e in s.table]
    bars = ax.bar(range(len(values)), values, color=colours)
    top = max(values + [s.ideal_images_per_sec * s.per_example])
    for i, (bar, e) in enumerate(zip(bars, s.table)):
      if e.images_per_sec is None:
        ax.text(i, top * 0.02, "cannot run", rotation=90, ha="center", va="bottom", fontsize=7)
      elif e.goodput == MISSES:
        bar.set_hatch("//")
        bar.set_edgecolor("#C44E52")
        ax.text(i, values[i], "misses", ha="center", va="bottom", fontsize=7, color="#C44E52")
      elif e.goodput == REACHES:
        ax.text(i, values[i], "reaches", ha="center", va="bottom", fontsize=6, color="#55A868")
    ideal = s.ideal_images_per_sec * s.per_example
    ax.axhline(ideal, color="#C44E52", linestyle="--", linewidth=1)
    ax.text(-0.4, ideal, f"ideal aggregate {ideal:.0f}", ha="left", va="bottom", fontsize=7, color="#C44E52")
    ax.set_ylim(0, top * 1.1)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels([e.row for e in s.table], rotation=40, ha="right", fontsize=7)
    trained = any(not e.goodput.startswith(NOT_TRAINED) for e in s.table)
    known = "" if trained else "; goodput unknown (no convergence data)"
    ax.set(title=f"{s.model} on {s.cluster.name} (batch {s.batch_size}){known}", ylabel=f"{s.unit}/s (simulated)")
    ax.grid(alpha=0.3, axis="y")
  fig.legend(handles=[Patch(color="#999999", label="peers"), Patch(color="#4C72B0", label="HetPipe"),
                      Patch(facecolor="white", edgecolor="#C44E52", hatch="//", label="misses the target")],
             fontsize=7, loc="lower left", ncol=3)
  return common.save_figure(fig, path)


def charts(rows: list[SubStudyRow], out_dir: str) -> list[str]:
  """The sub-studies' charts: Nm sweep, whimpy GPUs."""
  plt = common.pyplot()
  paths = []
  models = list(dict.fromkeys(r.model for r in rows if r.study == "nm"))
  if models:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
      for config in dict.fromkeys(r.config for r in rows if r.model == model and r.study == "nm"):
        pts = [r for r in rows if r.model == model and r.study == "nm" and r.config == config]
        ax.plot([r.nm for r in pts], [r.images_per_sec for r in pts], "o-", label=config)
      ax.set(title=f"{model}: one virtual worker", xlabel="Nm", ylabel="examples/s (simulated)")
      ax.legend(fontsize=7)
      ax.grid(alpha=0.3)
    paths.append(common.save_figure(fig, os.path.join(out_dir, "throughput_nm.png")))
  models = list(dict.fromkeys(r.model for r in rows if r.study == "whimpy"))
  if models:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
      pts = [r for r in rows if r.model == model and r.study == "whimpy"]
      ax.bar(range(len(pts)), [r.images_per_sec for r in pts],
             color=["#999999" if r.config.startswith("Horovod") else "#4C72B0" for r in pts])
      ax.set_xticks(range(len(pts)))
      ax.set_xticklabels([r.config for r in pts], rotation=30, ha="right", fontsize=7)
      ax.set(title=f"{model}: whimpy GPUs", ylabel="examples/s (simulated)")
      ax.grid(alpha=0.3, axis="y")
    paths.append(common.save_figure(fig, os.path.join(out_dir, "throughput_whimpy.png")))
  return paths


def print_rows(rows: list[SubStudyRow]) -> None:
  """The sub-studies' rows."""
  if not rows:
    return
  print(f"{'model':10} {'study':11} {'config':52} {'GPUs':>4} {'Nm':>3} {'xfer':>7} {'ex./s':>9} {'ideal':>8} "
        f"{'eff.':>5}")
  for r in rows:
    print(f"{r.model:10} {r.study:11} {r.config[:52]:52} {r.gpus:>4} {r.nm:>3} {r.transfers:>7} "
          f"{r.images_per_sec:9.1f} {r.ideal_images_per_sec:8.1f} {r.efficiency:5.2f}")
  print("sub-studies (outside the table): ideal is the sum of the standalone rates of the row's GPUs, eff. "
        "the examples/s over it")


def print_table(s: ModelTable) -> None:
  """The model's table."""
  best = s.best_peer
  sources = ", ".join(d["path"] for d in s.convergence) or "no matching convergence data"
  peer = "none runs" if best is None else f"{best.row}, {best.throughput:.1f} {s.unit}/s"
  print(f"\n{s.model} on {s.cluster.name}, batch {s.batch_size}: ideal aggregate "
        f"{s.ideal_images_per_sec * s.per_example:.1f} {s.unit}/s; best peer {peer}; goodput from {sources}")
  print(f"{'row':28} {'config':58} {'GPUs':>4} {s.unit + '/s':>10} {'eff.':>5} {'MFU':>5} {'vs peer':>7} "
        f"{'goodput':>11}")
  for e in s.table:
    if e.images_per_sec is None:
      print(f"{e.row:28} cannot run: {e.reason}")
      continue
    ratio = "-" if e.ratio_to_best_peer is None else f"{e.ratio_to_best_peer:.2f}x"
    print(f"{e.row:28} {e.config[:58]:58} {e.gpus:>4} {e.throughput:10.1f} {e.efficiency:5.2f} {e.mfu:5.2f} "
          f"{ratio:>7} {e.goodput:>11}")
  for note in s.notes:
    print(note)
  for system, b in s.breakdowns.items():  # the largest shares first, those of at least 0.5%
    parts = ", ".join(f"{c} {v:.3f}" for c, v in sorted(b["shares"].items(), key=lambda cv: -cv[1]) if v >= 0.005)
    print(f"time of {system}'s fastest row ({b['row']}), mean over the GPUs that train: {parts}")


def print_headlines(studies: list[ModelTable]) -> None:
  print("eff.: over the ideal aggregate (the sum of every GPU's standalone rate); MFU: the model's flops over the "
        "fp32 peak of every GPU; vs peer: over the best peer's "
        f"{'/'.join(sorted({s.unit for s in studies}))}/s; goodput: whether the row's training reached the target "
        "in the convergence study (every seed), missed it (some seed), or was not trained")
  print("simulated cluster (cost model: roofline with the calibrated catalogue's efficiency per GPU type and model "
        "family, links of the preset); not measured on GPUs")
  for s in studies:
    table = {e.row: e for e in s.table}
    print(f"fastest overall, {s.model}: {describe(table.get(s.headline.fastest or ''))}")
  for s in studies:
    print(f"headline, {s.model}: {s.headline.note}")


def flags_to_config() -> tuple[ThroughputConfig, list[str]]:
  """The study's configuration and the convergence files to read, from the flags (a bad value refused in one
  line)."""
  system_flags.import_from_flags(FLAGS)
  config = ThroughputConfig(
      get_cluster(FLAGS.cluster), tuple(FLAGS.models), FLAGS.batch_size, FLAGS.gpt_batch_size, FLAGS.seq_len,
      FLAGS.waves, FLAGS.nm_max, tuple(common.parse_ints("ds", FLAGS.ds)),
      tuple(common.parse_ints("tune_ds", FLAGS.tune_ds)) if FLAGS.tune_ds else (), tuple(FLAGS.sub_studies),
      FLAGS.whimpy, FLAGS.optimizer, FLAGS.overlap_transfers, FLAGS.tuned, FLAGS.max_stages, FLAGS.tuned_objective,
      tuple(FLAGS.systems), peer_flags.knobs_from_flags(FLAGS), tuple(FLAGS.nms), FLAGS.recompute)
  if FLAGS.convergence is None:
    paths = [DEFAULT_CONVERGENCE] if os.path.exists(DEFAULT_CONVERGENCE) else []
  else:
    paths = [p for p in FLAGS.convergence if p]
  return config, paths


def main(argv):
  del argv
  config, paths = flags_to_config()
  result = run_throughput(config, common.batch_profiles, convergence_docs(paths), paths,
                          lambda line: common.progress("%s", line))
  rows = result.rows
  outputs = [("json", common.write_json(common.output_path(FLAGS.out_dir, "throughput.json"), result.to_json())),
             ("csv", common.write_dict_csv(common.output_path(FLAGS.out_dir, "throughput.csv"),
                                           [e._asdict() for s in result.models for e in s.table]))]
  if rows:
    outputs.append(("csv", common.write_dict_csv(common.output_path(FLAGS.out_dir, "throughput_rows.csv"),
                                                 [r._asdict() for r in rows])))
  outputs.append(("chart", table_chart(result.models, common.output_path(FLAGS.out_dir, "throughput_table.png"))))
  outputs += [("chart", p) for p in charts(rows, FLAGS.out_dir)]
  print_rows(rows)
  for s in result.models:
    print_table(s)
  print_headlines(result.models)
  common.print_outputs(outputs, width=6)


cli = common.console(main)

if __name__ == "__main__":
  cli()
