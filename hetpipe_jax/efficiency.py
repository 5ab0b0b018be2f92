"""``python -m hetpipe_jax.efficiency TRACE [TIME_SCALE] [--cluster=FILE] [--model=package.module:factory]``
(or a peer's ``TIMELINE.json``): where every GPU-second of a run went, and how close it came to the ideal
heterogeneous aggregate.

Prints, per GPU, the share of the run spent computing, receiving inputs over links, in pipeline bubbles,
blocked by the Nm window, blocked at the WSP gate, pulling, waiting for its own push, done early or
failed (:mod:`hetpipe_jax.core.breakdown`); per virtual worker and for the cluster, efficiency = achieved
images/s over the ideal aggregate (the sum of each GPU's standalone rate on the model by the cost model:
:func:`hetpipe_jax.plan.costmodel.ideal_images_per_sec`). Writes a stacked bar chart (``.efficiency.png``)
and the numbers (``.efficiency.json``) beside the trace.

The cost model (for the compute part of each task and for the ideal) is rebuilt from the trace's meta
line: cluster, model (or ``time_model``), batch size, layout. ``virtual`` and ``sim`` traces are on the
emulated cluster's clock; a ``wall`` or ``multiprocess`` trace is in wall seconds, so efficiency needs
the run's ``--time_scale`` (TIME_SCALE: wall seconds per emulated second); without it, tasks count as
compute and no efficiency is given. A run on a cluster from a TOML file, or of a user's model, names them in
its meta line by their names only: give the file (``--cluster=lab.toml``) and the factory
(``--model=mymodel:model``) the run was given, else its tasks count as compute (no link time, no efficiency).

A peer's timeline (``experiments.baseline``, :mod:`hetpipe_jax.baselines.timeline`) has its own
categories: compute, link, bubble, allreduce, sync, unused.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax.numpy as jnp

from hetpipe_jax.baselines.timeline import is_timeline, timeline_report
from hetpipe_jax.cluster import Cluster, get_cluster
from hetpipe_jax.core.breakdown import CATEGORIES, pushed_images, shares, time_breakdown
from hetpipe_jax.core.trace import trace_cli
from hetpipe_jax.cost.profile import full_size_profiles, profile_units
from hetpipe_jax.data import load_dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE, get_model
from hetpipe_jax.plan.costmodel import CostModel, ideal_images_per_sec
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.workdir import import_from_working_directory

COLOURS = {"compute": "#4C72B0", "link": "#8172B2", "bubble": "#CCB974", "window": "#64B5CD", "gate": "#C44E52",
           "pull": "#DD8452", "push": "#937860", "done": "#BBBBBB", "left": "#333333",
           "allreduce": "#55A868", "sync": "#DA8BC3", "unused": "#EEEEEE"}  # (the last three: a peer's timeline)


def trace_costs(meta: dict[str, Any], cluster: Cluster | None = None, model: str | None = None):
  """(cluster, profiles, layout) of a trace's run, rebuilt from its meta line.

  Args:
    meta: the trace's meta line.
    cluster: the run's cluster; None: the preset the meta line names.
    model: the run's ``package.module:factory`` (a user's model, which the meta line names by its name
      only); None: the model the meta line names.

  Raises:
    ConfigError: when the cluster or the model cannot be rebuilt (naming which).
  """
  cluster = cluster or get_cluster(meta["cluster"])
  batch = meta["batch_size"]
  name = meta.get("time_model") or meta["model"]
  if model is not None and not meta.get("time_model"):  # (a time_model times the tasks: the factory's is moot)
    built = get_model(model).name
    if built != name:
      raise ConfigError(f"the trace's model is {name!r}, and {model} builds {built!r}: give the factory the run "
                        "was given")
    name = model
  full = [key for key in FULL_SIZE if name in (key, get_model(key).name)]  # traces name the model class
  if full:
    profiles = full_size_profiles(full[0], batch)
  else:  # a small model trained on a dataset: profile it as the run did
    dataset = load_dataset(meta["dataset"])
    profiles = profile_units(get_model(name, dataset.num_classes), jnp.asarray(dataset.x_train[:batch]))
  by_name = {g.name: g for g in cluster.gpus}
  named = [n for group in meta["gpus"] for n in group] + [n for vw in meta.get("tp") or [] for s in vw for n in s]
  missing = [n for n in named if n not in by_name]
  if missing:
    raise ConfigError(f"the trace's GPUs {missing[:3]} are not in cluster {meta['cluster']!r}")
  windows = meta.get("window") or meta["nm"]
  modes = meta.get("recompute") or [None] * len(meta["nm"])  # each stage's recomputation, when one recomputes
  splits = meta.get("tp") or [None] * len(meta["nm"])  # each stage's tensor-parallel partners, when one has some
  partners = lambda tp: None if tp is None else tuple(tuple(by_name[n] for n in names) for names in tp)
  layout = Layout(tuple(VWLayout(tuple(by_name[n] for n in group), tuple(cuts), nm, w, None if r is None else tuple(r),
                                 partners(tp))
                        for group, cuts, nm, w, r, tp in zip(meta["gpus"], meta["cuts"], meta["nm"], windows, modes,
                                                             splits)))
  return cluster, profiles, layout


def efficiency_report(events: list[dict[str, Any]], time_scale: float | None = None,
                      cluster: Cluster | str | None = None, model: str | None = None) -> dict[str, Any]:
  """The breakdown and the efficiencies of a trace (see the module docstring).

  Args:
    events: the trace.
    time_scale: wall seconds per emulated second of a ``wall``/``multiprocess`` run (None: the trace is
      on the emulated clock for ``virtual`` and ``sim``, unknown otherwise).
    cluster: the run's cluster, when the trace's meta line names one that is not a preset (a
      :class:`~hetpipe_jax.cluster.Cluster`, or a TOML file's path); None: the preset it names.
    model: the run's ``package.module:factory``, for a user's model (its meta line names it by its name
      only); None: the model the meta line names.

  Returns:
    ``seconds`` (the run's length), ``devices`` and ``shares`` (per GPU: its seconds and share of the run
    in each category of :mod:`hetpipe_jax.core.breakdown`), ``note`` (why a part is missing, or None);
    with a cost model also ``vws`` (per virtual worker: images/s, its GPUs' ideal, efficiency) and the
    cluster's ``images_per_sec``, ``ideal_images_per_sec`` and ``efficiency``.
  """
  meta = events[0]
  if isinstance(cluster, str):
    cluster = get_cluster(cluster)
  if cluster is not None and cluster.name != meta["cluster"]:
    raise ConfigError(f"the trace ran on cluster {meta['cluster']!r}, not on the given {cluster.name!r}: "
                      "give the run's cluster (or none for a preset)")
  scale = time_scale if time_scale else (1.0 if meta.get("executor") in ("virtual", "sim") else None)
  note, cost = None, None
  try:
    run_cluster, profiles, layout = trace_costs(meta, cluster, model)
    cost = CostModel(run_cluster, profiles, layout)
  except (ConfigError, KeyError) as e:
    if model is not None and isinstance(e, ConfigError):
      raise  # the factory given cannot be the run's
    note = f"no cost model for this trace ({e}): tasks count as compute, no efficiency"
  if cost is not None and scale is None:
    note = (f"a {meta.get('executor')} trace is in wall seconds: give its --time_scale to get efficiency; "
            "tasks count as compute")
  compute = None if cost is None or scale is None else (
      lambda i, j, kind: cost.compute_seconds(i, j, kind) * scale)
  breakdown = time_breakdown(events, compute)
  report: dict[str, Any] = {"seconds": breakdown["seconds"], "devices": breakdown["devices"],
                            "shares": shares(breakdown), "note": note}
  if compute is None or breakdown["seconds"] <= 0:
    return report
  emulated = breakdown["seconds"] / scale
  images = pushed_images(events, meta["batch_size"])
  batch = meta["batch_size"]
  report["vws"] = [{"vw": i, "images_per_sec": images[i] / emulated,
                    "ideal_images_per_sec": ideal_images_per_sec(run_cluster, profiles, batch, vw.gpus)}
                   for i, vw in enumerate(layout.vws)]
  for row in report["vws"]:
    row["efficiency"] = row["images_per_sec"] / row["ideal_images_per_sec"]
  report["images_per_sec"] = sum(images) / emulated
  report["ideal_images_per_sec"] = ideal_images_per_sec(run_cluster, profiles, batch)
  report["efficiency"] = report["images_per_sec"] / report["ideal_images_per_sec"]
  return report


def plot_breakdown(report: dict[str, Any], path: str, title: str = "") -> None:
  """A stacked bar per GPU: the share of the run in each category (a PNG at ``path``, drawn on a figure of
  its own, not through pyplot: a notebook's or a script's matplotlib backend stays as it is)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  devices, fractions = report["devices"], report["shares"]
  fig = Figure(figsize=(max(6.0, 0.5 * len(devices) + 2), 4.5))
  ax = fig.subplots()
  bottom = [0.0] * len(devices)
  for c in report.get("categories", CATEGORIES):
    values = [f[c] for f in fractions]
    if any(v > 0 for v in values):
      ax.bar(range(len(devices)), values, bottom=bottom, color=COLOURS[c], label=c)
      bottom = [b + v for b, v in zip(bottom, values)]
  ax.set_xticks(range(len(devices)))
  ax.set_xticklabels([f"VW{d['vw']}.{d['stage']} {d['gpu']}" for d in devices], rotation=60, ha="right",
                     fontsize=7)
  eff = f"; efficiency {report['efficiency']:.2f} of the ideal aggregate" if "efficiency" in report else ""
  ax.set(ylabel="share of the run", ylim=(0, 1), title=(title + eff).strip("; "))
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=110)


USAGE = ("python -m hetpipe_jax.efficiency TRACE.jsonl [TIME_SCALE] [--cluster=FILE.toml] "
         "[--model=package.module:factory] | TIMELINE.json")
OPTIONS = ("cluster", "model")


def main(argv: list[str]) -> int:
  """The command line (module docstring): exit 0 with the report, 2 with one line for bad input."""
  options: dict[str, str] = {}
  for arg in argv[1:]:
    if arg.startswith("--"):
      key, _, value = arg[2:].partition("=")
      options[key] = value
  if bad := [f"--{o}={v}" for o, v in options.items() if o not in OPTIONS or not v]:
    print(f"error: {bad[0]} is not an option (give --cluster=FILE.toml or --model=package.module:factory); "
          f"usage: {USAGE}", file=sys.stderr)
    return 2
  argv = [a for a in argv if not a.startswith("--")]
  if len(argv) == 2 and not options and is_timeline(argv[1]):
    return _timeline(argv[1])
  return trace_cli(argv, USAGE, 2, lambda events, args: _report(events, args, options))


def _timeline(path: str) -> int:
  """A peer's timeline (:mod:`hetpipe_jax.baselines.timeline`): its breakdown, efficiency, chart and JSON."""
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  report = timeline_report(doc)
  categories = report["categories"]
  print(f"{'GPU':24} {'worker.stage':12} " + " ".join(f"{c:>9}" for c in categories))
  for d, share in zip(report["devices"], report["shares"]):
    worker = f"{d['vw']}.{d['stage']}" if d["vw"] >= 0 else "-"
    print(f"{d['gpu']:24} {worker:12} " + " ".join(f"{share[c]:9.3f}" for c in categories))
  if "efficiency" in report:
    print(f"cluster: {report['images_per_sec']:.1f} images/s of an ideal aggregate "
          f"{report['ideal_images_per_sec']:.1f}: efficiency {report['efficiency']:.3f}")
  base = path[:-len(".timeline.json")] if path.endswith(".timeline.json") else os.path.splitext(path)[0]
  with open(base + ".efficiency.json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  meta = doc["meta"]
  plot_breakdown(report, base + ".efficiency.png", f"{meta['system']}: {meta.get('model')} on {meta['cluster']}")
  print(f"json     {os.path.abspath(base + '.efficiency.json')}")
  print(f"chart    {os.path.abspath(base + '.efficiency.png')}")
  return 0


def _report(events: list[dict[str, Any]], argv: list[str], options: dict[str, str]) -> int:
  if len(events) < 2:
    print(f"error: {argv[1]} holds no event after its meta line: nothing ran to break down; give the trace of a "
          "run", file=sys.stderr)
    return 2
  time_scale = None
  if len(argv) == 3:
    try:
      time_scale = float(argv[2])
    except ValueError:
      time_scale = -1.0
    if not time_scale > 0 or time_scale == float("inf"):
      print(f"error: TIME_SCALE={argv[2]!r}; give the run's --time_scale, a number > 0", file=sys.stderr)
      return 2
  try:
    report = efficiency_report(events, time_scale, options.get("cluster"), options.get("model"))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except (KeyError, TypeError, IndexError) as e:
    print(f"error: {argv[1]} is not a complete hetpipe trace ({type(e).__name__}: {e}); give a trace that "
          "experiments.train wrote", file=sys.stderr)
    return 2
  print(f"{'GPU':24} {'VW.stage':8} " + " ".join(f"{c:>7}" for c in CATEGORIES))
  for d, f in zip(report["devices"], report["shares"]):
    print(f"{d['gpu']:24} {d['vw']:>4}.{d['stage']:<3} " + " ".join(f"{f[c]:7.3f}" for c in CATEGORIES))
  if report["note"]:
    print(report["note"])
  for row in report.get("vws", []):
    print(f"VW {row['vw']}: {row['images_per_sec']:.1f} images/s of an ideal {row['ideal_images_per_sec']:.1f} "
          f"(its GPUs alone): efficiency {row['efficiency']:.3f}")
  if "efficiency" in report:
    print(f"cluster: {report['images_per_sec']:.1f} images/s of an ideal aggregate "
          f"{report['ideal_images_per_sec']:.1f}: efficiency {report['efficiency']:.3f}")
  base = os.path.splitext(argv[1])[0]
  with open(base + ".efficiency.json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  meta = events[0]
  plot_breakdown(report, base + ".efficiency.png", f"{meta.get('model')} on {meta.get('cluster')}, "
                 f"{meta.get('executor')}")
  print(f"json     {os.path.abspath(base + '.efficiency.json')}")
  print(f"chart    {os.path.abspath(base + '.efficiency.png')}")
  return 0


def cli() -> None:
  """The ``hetpipe-efficiency`` console entry point."""
  import_from_working_directory()
  sys.exit(main(sys.argv))


if __name__ == "__main__":
  cli()
