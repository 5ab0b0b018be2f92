r"""The simulator against published measurements of real multi-GPU hardware (issue 24).

Every row of ``experiments/data/published.csv`` is a measurement someone published, with its source, its
setup (one machine and software stack of one source), its hardware (catalogue names of GPUs and links), the
system it ran and the figure. Each row is simulated on the same cost model, catalogue, links and network as
every study of hetpipe_jax, by the peer of :mod:`hetpipe_jax.baselines` that the row names:

* ``tf_replicated`` / ``tf_replicated_copy`` (tf_cnn_benchmarks' replicated variables with / without NCCL),
  ``horovod`` (Horovod, PyTorch's DDP), ``ps_sync`` / ``ps_replicated`` (TensorFlow's synchronous parameter
  server, every GPU or every host a worker), ``gpipe`` (torchgpipe's speed-ups over one GPU's plain training
  at ``baseline_batch``);
* ``nccl_allreduce`` (a raw all-reduce timing): :func:`hetpipe_jax.baselines.collective.allreduce` of the
  row's bytes on the row's GPUs, alone on the network;
* a row whose system is not named, or whose network the catalogue lacks, is reported with its reason and left
  out of the errors.

A published row ran at its batch, so its GPUs are not refused by the memory model when it is simulated;
``memory_model_holds`` says whether the memory model holds it, charged the activations that PyTorch or
TensorFlow keep (``activations="eager"``, :func:`hetpipe_jax.cost.memory.kept`; GPipe's stages with their
checkpointed microbatches), and the summary counts the rows it refuses.

Calibration (``--fit=setup``, the default): each GPU type's roofline efficiency per model family, per setup,
on that setup's single-GPU figures of the fit models (``--fit_models``: one per family; a one-GPU row's
figure or a multi-GPU row's ``one_gpu_figure``, simulated with the row's own system; a setup with none takes
the type's geometric mean over every setup); and the intra-node link's bandwidth and per-step latency per
setup, on its two-GPU raw all-reduce times (2a + S/B, least squares in relative error). ``--fit=type``: the
same per type and per link over every setup; ``--fit=none``: the catalogue as it is. Every other figure is
held out and its errors are reported apart: in the row's unit (simulated / published - 1) and in scaling
efficiency (images/s over N x the same setup's one-GPU figure, an absolute difference).

Writes validate_published.json, .csv and .png (simulated against published) in --out_dir; the last line is
``median_error=<x> worst_error=<y> cases=<n>`` over the held-out rows that ran.

  python -m experiments.validate_published
"""

from __future__ import annotations

import os

from absl import flags

from experiments import common
from hetpipe_jax.studies.published import (
  FIT_SCOPES,
  Entry,
  Summary,
  entry_json,
  evaluate,
  fit_efficiency,
  read_table,
  summary,
  summary_json,
)

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published.csv")

FLAGS = flags.FLAGS
flags.DEFINE_string("table", TABLE, "The published measurements (CSV, one row per measurement).")
flags.DEFINE_enum("fit", "setup", list(FIT_SCOPES), "Fit each GPU type's efficiency per family on the "
                  "single-GPU figures of --fit_models: per setup (one machine and software stack of one source), "
                  "per type over every setup, or none (the catalogue's as they are).")
flags.DEFINE_list("fit_models", ["resnet50", "vgg16", "inception_v3"], "The models whose single-GPU figures the "
                  "fit uses (one per family); every other row is held out.")
flags.DEFINE_string("out_dir", "outputs/validate_published", "Where the JSON, CSV and chart go.")

COLUMNS = ("id", "category", "setup", "gpu", "gpus", "nodes", "system", "model", "batch_per_gpu", "figure", "unit",
           "simulated", "error", "published_scaling", "simulated_scaling", "fitted", "memory_model_holds", "reason")


def plot(entries: list[Entry], path: str) -> None:
  """Simulated against published, one marker per category, fitted rows hollow."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 6))
  ran = [(e.row.category, e.fitted, e.row.figure, e.simulated) for e in entries
         if e.simulated is not None and e.row.unit == "images_per_sec"]
  for k, category in enumerate(dict.fromkeys(c for c, *_ in ran)):
    for fitted in (False, True):
      points = [(figure, simulated) for c, f, figure, simulated in ran if c == category and f == fitted]
      if points:
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=22, edgecolors=f"C{k}",
                   facecolors="none" if fitted else f"C{k}", label=f"{category}{' (fitted)' if fitted else ''}")
  if ran:
    lo, hi = min(p[2] for p in ran) * 0.8, max(p[2] for p in ran) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    for k in (0.9, 1.1):
      ax.plot([lo, hi], [k * lo, k * hi], color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
  ax.set_xlabel("published images/s")
  ax.set_ylabel("simulated images/s")
  ax.set_title("the simulator against published measurements (dotted: +-10%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def print_table(entries: list[Entry], stats: Summary) -> None:
  print(f"{'id':44} {'published':>10} {'simulated':>10} {'error':>7} {'scaling pub/sim':>16}")
  for e in entries:
    if e.simulated is None or e.error is None:
      print(f"{e.id[:44]:44} {e.row.figure:10.4g} {'-':>10} {'-':>7}  {str(e.reason)[:60]}")
      continue
    scaling = (f"{e.published_scaling:.2f}/{e.simulated_scaling:.2f}" if e.scaling_error is not None else "")
    mark = " (fitted)" if e.fitted else ""
    print(f"{e.id[:44]:44} {e.row.figure:10.4g} {e.simulated:10.4g} {100 * e.error:+6.1f}% {scaling:>16}{mark}")
  for name, s in (("held out", stats.held_out), ("fitted", stats.fitted)):
    if s.cases:
      print(f"{name}: {s.cases} rows, median error {100 * (s.median_error or 0.0):.1f}%, worst "
            f"{100 * (s.worst_error or 0.0):.1f}%" + (f"; scaling efficiency median {s.median_scaling_error:.3f}, "
                                                    f"worst {s.worst_scaling_error:.3f}"
                                                    if s.median_scaling_error is not None else ""))


def main(argv):
  del argv
  rows = read_table(FLAGS.table)
  calibration = fit_efficiency(rows, FLAGS.fit_models, FLAGS.fit)
  entries = evaluate(rows, calibration)
  stats = summary(entries)
  paths = {k: common.output_path(FLAGS.out_dir, f"validate_published.{k}") for k in ("json", "csv", "png")}
  docs = [entry_json(e) for e in entries]
  common.write_json(paths["json"], {"table": FLAGS.table, "fit": FLAGS.fit, "fit_models": FLAGS.fit_models,
                                    "fit_points": [r._asdict() for r in calibration.records],
                                    "summary": summary_json(stats), "rows": docs})
  common.write_csv(paths["csv"], COLUMNS, ([d.get(c) for c in COLUMNS] for d in docs))
  plot(entries, paths["png"])
  print_table(entries, stats)
  print(f"memory model: holds {stats.training_rows - len(stats.memory_refused)} of {stats.training_rows} training "
        f"rows at their batch; refuses {', '.join(stats.memory_refused) or 'none'}")
  for kind, path in paths.items():
    print(f"{kind:5} {path}")
  held = stats.held_out
  print(f"median_error={held.median_error if held.cases else float('nan'):.4f} "
        f"worst_error={held.worst_error if held.cases else float('nan'):.4f} cases={held.cases}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
