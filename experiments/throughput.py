r"""The paper's throughput study on the simulated cluster (the ``sim`` executor and the planner).

Defaults reproduce the paper's setting: the 16-GPU ``paper_testbed``, VGG-19 and ResNet-152 at 224x224,
batch 32, momentum SGD, weight stashing. For each model:

  (a) nm:      one virtual worker as Nm grows, for several GPU mixes;
  (b) policy:  NP, ED, HD with default and local placement (planned partitions and Nm, D in --ds), the
               tuned configuration (``experiments.tune``: grouping, Nm per virtual worker, D, placement and
               transfer model searched), and the Horovod-style baseline on the GPUs that hold the whole model,
               with its all-reduce after the backward pass and overlapped with it (the fair baseline of a
               run whose transfers overlap computation);
  (c) whimpy:  HetPipe (ED, local) on the 12 non-whimpy GPUs vs. all 16, and Horovod.

Writes throughput.json (rows {"model", "study", "config", "gpus", "nm", "d", "transfers", "images_per_sec",
"ideal_images_per_sec", "efficiency"}: the ideal heterogeneous aggregate of the row's GPUs, and images/s
over it; "transfers": serial or overlapped with computation, and the ratio to Horovod is to the baseline
with the same transfer model), a CSV and
PNG charts to --out_dir, prints a table with the ratios to Horovod, and the paths::

  python -m experiments.throughput
  python -m experiments.throughput --models=vgg19 --waves=50
"""

from __future__ import annotations

import os

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["vgg19", "resnet152"], "Full-size models to study.")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or .toml file.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size.")
flags.DEFINE_integer("waves", 100, "Simulated waves per virtual worker.")
flags.DEFINE_integer("nm_max", 8, "Largest Nm in the single-virtual-worker sweep.")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D of the policy study.")
flags.DEFINE_string("whimpy", "RTX 2060", "GPU type left out of the 12-GPU side of study (c).")
flags.DEFINE_string("optimizer", "momentum", "Local optimizer, for its memory: sgd, momentum, adam.")
flags.DEFINE_string("out_dir", "outputs/throughput", "Where the JSON, CSV and charts go.")
flags.DEFINE_bool("overlap_transfers", False, "Simulate the NP/ED/HD rows' stage-to-stage transfers overlapped "
                  "with computation (a GPU receives its next input while it computes) instead of charged in "
                  "series.")
flags.DEFINE_bool("tuned", True, "Add the tuned configuration (experiments.tune's search) to the policy study.")


def simulated_images_per_sec(cluster, profiles, plans, d: int = 0, placement: str = "default") -> float:
  from hetpipe_jax.core.trace import Trace
  from hetpipe_jax.plan.layout import Layout
  from hetpipe_jax.sim import SimJob, SimOptions, simulate
  trace = Trace()
  seconds, vws, _ = simulate(SimJob(cluster, profiles, Layout(tuple(p.layout for p in plans)), d, FLAGS.waves,
                                    placement, options=SimOptions(overlap_transfers=FLAGS.overlap_transfers)),
                             trace)
  common.require_wsp(trace.events, "simulated run")
  return sum(vw.completed for vw in vws) * FLAGS.batch_size / seconds


class Study:
  """One model's rows on one cluster: what every part of the study shares."""

  def __init__(self, model_name: str, cluster):
    from hetpipe_jax.cost.profile import full_size_profiles
    from hetpipe_jax.optim import optimizer_slots
    self.model_name, self.cluster = model_name, cluster
    self.slots = optimizer_slots(FLAGS.optimizer)
    self.profiles = full_size_profiles(model_name, FLAGS.batch_size)
    self.rows: list[dict] = []

  def ideal(self, gpus=None, cluster=None) -> float:
    from hetpipe_jax.plan.costmodel import ideal_images_per_sec
    return ideal_images_per_sec(cluster or self.cluster, self.profiles, FLAGS.batch_size, gpus)

  def row(self, study_name, config, gpus, nm, d, ips, best, transfers=None) -> None:
    transfers = transfers or ("overlap" if FLAGS.overlap_transfers else "serial")  # the planned rows' model
    self.rows.append({"model": self.model_name, "study": study_name, "config": config, "gpus": gpus, "nm": nm,
                      "d": d, "transfers": transfers, "images_per_sec": ips, "ideal_images_per_sec": best,
                      "efficiency": ips / best})


def nm_rows(s: Study) -> None:
  """(a) one virtual worker, Nm = 1 .. nm_max."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import allocate
  from hetpipe_jax.plan.partition import partition
  ed, hd, nodes = allocate(s.cluster, "ED")[0], allocate(s.cluster, "HD")[0], allocate(s.cluster, "NP")
  mixes = {"ED mix (1 of each type)": ed, "HD mix (fast + whimpy)": hd,
           f"one node ({nodes[0][0].type.name})": nodes[0]}
  for label, gpus in mixes.items():
    for nm in range(1, FLAGS.nm_max + 1):
      try:
        plan = partition(s.cluster, s.profiles, gpus, nm, CostContext(optimizer_slots=s.slots))
      except ConfigError:
        break  # memory grows with Nm
      s.row("nm", label, len(gpus), nm, 0, simulated_images_per_sec(s.cluster, s.profiles, [plan]), s.ideal(gpus))
      common.progress("%s %s Nm=%d: %.1f images/s", s.model_name, label, nm, s.rows[-1]["images_per_sec"])


def horovod_rates(s: Study) -> tuple[list, dict[bool, float]]:
  """(the GPUs that hold the model, Horovod's images/s on them with and without overlapped all-reduce)."""
  from hetpipe_jax.baselines.horovod import horovod_images_per_second
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import horovod_gpus
  gpus = horovod_gpus(s.cluster, s.profiles, CostContext(optimizer_slots=s.slots))
  return gpus, {overlap: horovod_images_per_second(s.cluster, s.profiles, gpus, FLAGS.batch_size, overlap=overlap)
                if gpus else 0 for overlap in (False, True)}


def policy_rows(s: Study, ds: list[int], baseline_gpus, horovod: dict[bool, float]) -> None:
  """(b) allocation policies and placements vs. Horovod."""
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import plan_cluster
  s.row("policy", "Horovod", len(baseline_gpus), 1, 0, horovod[False], s.ideal(), "serial")  # the others idle
  s.row("policy", "Horovod, all-reduce overlapped", len(baseline_gpus), 1, 0, horovod[True], s.ideal(), "overlap")
  for policy in ("NP", "ED", "HD"):
    for placement in ("default", "local"):
      plan = plan_cluster(s.cluster, s.profiles, policy, placement, "max_fit", None,
                          CostContext(optimizer_slots=s.slots))
      for d in ds:
        ips = simulated_images_per_sec(s.cluster, s.profiles, plan.vws, d, placement)
        config = f"{policy}-{placement}" + (f" D={d}" if d else "")
        s.row("policy", config, s.cluster.num_gpus, max(p.nm for p in plan.vws), d, ips, s.ideal())
        common.progress("%s %s: %.1f images/s", s.model_name, config, ips)


def tuned_row(s: Study, ds: list[int]) -> None:
  """(b) the tuner's best configuration."""
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune
  best = tune(s.cluster, s.profiles, FLAGS.batch_size, SearchSpace(ds=tuple(ds)),
              TuneOptions(waves=FLAGS.waves, setting=RunSetting(CostContext(optimizer_slots=s.slots)),
                          progress=lambda line: common.progress("%s tuner: %s", s.model_name, line))).best
  c = best.candidate
  staged = ", staged PS" if c.sim.staged_ps else ""
  s.row("policy", f"tuned: {c.grouping}, Nm {c.nm_rule}, D={c.d}, {c.placement}{staged}", s.cluster.num_gpus,
        max(p.nm for p in c.plans), c.d, best.images_per_sec, s.ideal(),
        "overlap" if c.sim.overlap_transfers else "serial")
  common.progress("%s tuned (%s): %.1f images/s", s.model_name, c.label, best.images_per_sec)


def whimpy_rows(s: Study, baseline_gpus, horovod: dict[bool, float]) -> None:
  """(c) whimpy GPUs: HetPipe on the others, HetPipe on all, Horovod."""
  from hetpipe_jax.cluster import make_cluster
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import plan_cluster
  cluster = s.cluster
  kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
          if cluster.node_gpus(n)[0].type.name != FLAGS.whimpy]
  without = make_cluster(f"{cluster.name}-no-whimpy", kept, cluster.intra_node, cluster.inter_node)
  for label, c in ((f"HetPipe ED-local, {without.num_gpus} GPUs (no {FLAGS.whimpy})", without),
                   (f"HetPipe ED-local, {cluster.num_gpus} GPUs", cluster)):
    plan = plan_cluster(c, s.profiles, "ED", "local", "max_fit", None, CostContext(optimizer_slots=s.slots))
    s.row("whimpy", label, c.num_gpus, max(p.nm for p in plan.vws), 0,
          simulated_images_per_sec(c, s.profiles, plan.vws, 0, "local"), s.ideal(cluster=c))
  s.row("whimpy", f"Horovod, {len(baseline_gpus)} GPUs that hold the model", len(baseline_gpus), 1, 0,
        horovod[False], s.ideal(), "serial")


def study(model_name: str, cluster, ds: list[int]) -> list[dict]:
  """Every row of one model: Nm, policies (and the tuned configuration), whimpy GPUs."""
  s = Study(model_name, cluster)
  nm_rows(s)
  baseline_gpus, horovod = horovod_rates(s)
  policy_rows(s, ds, baseline_gpus, horovod)
  if FLAGS.tuned:
    tuned_row(s, ds)
  whimpy_rows(s, baseline_gpus, horovod)
  return s.rows


def charts(rows: list[dict], out_dir: str) -> list[str]:
  plt = common.pyplot()
  models = sorted({r["model"] for r in rows})
  paths = []
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
  for ax, model in zip(axes[0], models):
    for config in dict.fromkeys(r["config"] for r in rows if r["model"] == model and r["study"] == "nm"):
      pts = [r for r in rows if r["model"] == model and r["study"] == "nm" and r["config"] == config]
      ax.plot([r["nm"] for r in pts], [r["images_per_sec"] for r in pts], "o-", label=config)
    ax.set(title=f"{model}: one virtual worker", xlabel="Nm", ylabel="images/s (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  paths.append(os.path.join(out_dir, "throughput_nm.png"))
  common.save_figure(fig, paths[-1])
  for study_name in ("policy", "whimpy"):
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
      pts = [r for r in rows if r["model"] == model and r["study"] == study_name]
      colours = ["#999999" if r["config"].startswith("Horovod") else "#4C72B0" for r in pts]
      ax.bar(range(len(pts)), [r["images_per_sec"] for r in pts], color=colours)
      best = max(r["ideal_images_per_sec"] for r in pts)
      ax.axhline(best, color="#C44E52", linestyle="--", linewidth=1)
      ax.text(len(pts) - 0.5, best, f"ideal aggregate {best:.0f}", ha="right", va="bottom", fontsize=7,
              color="#C44E52")
      ax.set_xticks(range(len(pts)))
      ax.set_xticklabels([r["config"] for r in pts], rotation=30, ha="right", fontsize=7)
      ax.set(title=f"{model}: {study_name}", ylabel="images/s (simulated)")
      ax.grid(alpha=0.3, axis="y")
    paths.append(os.path.join(out_dir, f"throughput_{study_name}.png"))
    common.save_figure(fig, paths[-1])
  return paths


def main(argv):
  del argv
  from hetpipe_jax import get_cluster
  ds = common.parse_ints("ds", FLAGS.ds)
  if not ds or any(d < 0 for d in ds):
    raise common.config_error(f"--ds={','.join(FLAGS.ds)}; give one or more clock distance bounds D >= 0")
  cluster = get_cluster(FLAGS.cluster)
  rows = [r for model in FLAGS.models for r in study(model, cluster, ds)]
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "throughput.json"), rows)
  csv_out = common.write_dict_csv(common.output_path(FLAGS.out_dir, "throughput.csv"), rows)
  pngs = charts(rows, FLAGS.out_dir)
  print(f"{'model':10} {'study':7} {'config':52} {'GPUs':>4} {'Nm':>3} {'xfer':>7} {'images/s':>9} "
        f"{'vs Horovod':>10} {'ideal':>7} {'eff.':>5}")
  for r in rows:
    horovod = next(x["images_per_sec"] for x in rows if x["model"] == r["model"] and x["study"] == "policy"
                   and x["config"].startswith("Horovod") and x["transfers"] == r["transfers"])
    ratio = f"{r['images_per_sec'] / horovod:.2f}x" if horovod else "-"
    print(f"{r['model']:10} {r['study']:7} {r['config'][:52]:52} {r['gpus']:>4} {r['nm']:>3} {r['transfers']:>7} "
          f"{r['images_per_sec']:9.1f} {ratio:>10} {r['ideal_images_per_sec']:7.1f} {r['efficiency']:5.2f}")
  print("ideal: the sum of the standalone rates of the row's GPUs (the policy rows and Horovod: every GPU of "
        "the cluster); eff.: images/s over it; vs Horovod: over the baseline with the same transfer model "
        "(serial: all-reduce after the backward; overlap: all-reduce overlapped with it)")
  print("images/s of the simulated cluster (cost model: roofline with the calibrated catalogue's efficiency per "
        "GPU type and model family, links of the preset); not measured on GPUs")
  common.print_outputs([("json", json_out), ("csv", csv_out)] + [("chart", p) for p in pngs], width=6)


cli = common.console(main)

if __name__ == "__main__":
  cli()
