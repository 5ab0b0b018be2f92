r"""The throughput study on the simulated cluster: HetPipe against its peers, one table per model, goodput first.

Defaults reproduce the paper's setting: the 16-GPU ``paper_testbed``, VGG-19 and ResNet-152 at 224x224,
batch 32 (a GPT model: --gpt_batch_size), momentum SGD (for memory), weight stashing. For each model, one
table (``table`` in throughput.json, throughput.csv, throughput_table.png) with the rows

* the peers (:mod:`hetpipe_jax.baselines`, :func:`experiments.peer_runs.peer_specs`), simulated on the same
  network, cost model and memory model: ``horovod``, ``hetero_dp``, ``sync_pipeline``, ``local_sgd``
  (default knobs but --microbatches, --local_steps, --h_by_speed, as ``experiments.convergence`` sets them);
* ``HetPipe NP D=d``, ``HetPipe ED D=d``, ``HetPipe HD D=d`` for every d of --ds: the planner's partitions
  and Nm (max_fit), default placement, on the ``sim`` executor;
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
(c) ``whimpy``: HetPipe (ED, local) on the GPUs that are not --whimpy vs. all, and that Horovod estimate.
Row fields: {"model", "study", "config", "gpus", "nm", "d", "transfers", "images_per_sec",
"ideal_images_per_sec", "efficiency"}.

throughput.json: {"cluster", "tuned_objective", "convergence": the files read, "models": {model: {"unit",
"per_example", "batch_size", "ideal_images_per_sec", "best_peer", "convergence": the files that matched,
"table": [entries], "headline": {...}}}, "rows": [sub-study rows]}. A table entry: {"model", "row", "system",
"config", "objective", "gpus", "images_per_sec" (examples/s), "throughput" (``unit``/s), "unit",
"ideal_images_per_sec", "efficiency", "ratio_to_best_peer", "goodput", "time_to_target_s", "reason"}::

  python -m experiments.throughput
  python -m experiments.throughput --cluster=mixed64 --models=resnet152,gpt2-xl
  python -m experiments.throughput --models=vgg19 --convergence=outputs/convergence/convergence.json
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from absl import flags

from experiments import common, peer_flags
from hetpipe_jax.studies.throughput_goodput import MISSES, NOT_TRAINED, REACHES, goodput
from hetpipe_jax.systems import WSP, HetPipe, simulate_systems, systems

FLAGS = flags.FLAGS
SUB_STUDIES = ("nm", "closed_form", "whimpy")
flags.DEFINE_list("models", ["vgg19", "resnet152"], "Models to study: full-size ones (vgg19, resnet152, gpt2-xl, ...) "
                  "or small ones (mlp, cnn, vgg, resnet, gpt).")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset, mixed<N>[x<G>] or .toml file.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size of the image models.")
flags.DEFINE_integer("gpt_batch_size", 8, "Minibatch size of a GPT model (sequences; 0: --batch_size).")
flags.DEFINE_integer("seq_len", None, "GPT models: tokens per sequence (default: the model's context).")
flags.DEFINE_integer("waves", 100, "Simulated waves per virtual worker.")
flags.DEFINE_integer("nm_max", 8, "Largest Nm in the single-virtual-worker sweep.")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D of the HetPipe rows and the tuner.")
flags.DEFINE_list("tune_ds", None, "D values the tuner searches (default: --ds); fewer keep it quicker on large "
                  "clusters.")
flags.DEFINE_list("sub_studies", list(SUB_STUDIES), "Sub-studies outside the table: nm, closed_form, whimpy "
                  "(empty: none).")
flags.DEFINE_string("whimpy", "RTX 2060", "GPU type left out of one side of the whimpy sub-study.")
flags.DEFINE_string("optimizer", "momentum", "Local optimizer, for its memory: sgd, momentum, adam.")
flags.DEFINE_string("out_dir", "outputs/throughput", "Where the JSON, CSV and charts go.")
flags.DEFINE_bool("overlap_transfers", False, "Simulate the HetPipe policy rows' stage-to-stage transfers "
                  "overlapped with computation (a GPU receives its next input while it computes) instead of "
                  "charged in series.")
flags.DEFINE_bool("tuned", True, "Add the tuned rows (experiments.tune's search).")
flags.DEFINE_integer("max_stages", 0, "Most stages per virtual worker the tuner tries (0: no limit; a convergence "
                     "study of a small model limits them to its units, e.g. 4 for the MLP).")
flags.DEFINE_enum("tuned_objective", "time_to_accuracy", ["time_to_accuracy", "throughput"],
                  "What the 'HetPipe tuned' row optimises: predicted time to accuracy (the staleness model of the "
                  "matching --convergence file; images/s when there is none), or images/s.")
flags.DEFINE_list("systems", ["horovod", "hetero_dp", "sync_pipeline", "local_sgd"], "Peer systems of the table "
                  "(hetpipe_jax.systems, and those --systems_module registers).")
peer_flags.override_defaults(h_by_speed=True)  # the study's one default of its own (experiments.peer_flags)
flags.DEFINE_list("convergence", None, "convergence.json files (experiments.convergence) giving each row's goodput "
                  "mark; default: outputs/convergence/convergence.json if it exists; empty: none.")

HETPIPE = HetPipe.name
POLICIES = ("NP", "ED", "HD")
TUNED, TUNED_IPS, TUNED_OUTER = "HetPipe tuned", "HetPipe tuned for images/s", "HetPipe tuned + outer"
DEFAULT_CONVERGENCE = os.path.join("outputs", "convergence", "convergence.json")


class Study:
  """One model on one cluster: its profiles and batch, the table's entries and the sub-studies' rows."""

  def __init__(self, model_name: str, cluster, convergence: list[dict], sources: Sequence[str] = ()):
    from hetpipe_jax.cost.context import CostContext
    from hetpipe_jax.optim import optimizer_slots
    self.model_name, self.cluster = model_name, cluster
    gpt = model_name.lower().startswith("gpt")
    self.batch = FLAGS.gpt_batch_size if gpt and FLAGS.gpt_batch_size else FLAGS.batch_size
    self.costs = CostContext(optimizer_slots=optimizer_slots(FLAGS.optimizer))
    self.batch_profiles, self.per_example, self.unit = common.batch_profiles(model_name, self.batch, FLAGS.seq_len)
    self.profiles = list(self.batch_profiles.at(self.batch))
    self.convergence = [doc for doc in convergence if matches(doc, model_name, cluster.name)]
    self.sources = list(sources)  # every convergence file read, matching or not
    self.rows: list[dict] = []
    self.table: list[dict] = []
    self.notes: list[str] = []  # printed under the table

  def best_peer(self) -> dict | None:
    """The peer entry with the most images/s (None: no peer ran)."""
    peers = [e for e in self.table if is_peer(e) and e["images_per_sec"]]
    return max(peers, key=lambda e: e["images_per_sec"], default=None)

  def ideal(self, gpus=None, cluster=None) -> float:
    from hetpipe_jax.plan.costmodel import ideal_images_per_sec
    return ideal_images_per_sec(cluster or self.cluster, self.profiles, self.batch, gpus)

  def row(self, study_name, config, gpus, nm, d, ips, best, transfers=None) -> None:
    """A sub-study's row."""
    transfers = transfers or ("overlap" if FLAGS.overlap_transfers else "serial")  # the planned rows' model
    self.rows.append({"model": self.model_name, "study": study_name, "config": config, "gpus": gpus, "nm": nm,
                      "d": d, "transfers": transfers, "images_per_sec": ips, "ideal_images_per_sec": best,
                      "efficiency": ips / best})

  def entry(self, row: str, system: str, config: str, gpus: int | None, ips: float | None,
            reason: str | None = None, objective: str | None = None, signature: list | None = None) -> None:
    """A row of the table: ``ips`` examples/s, or None and the ``reason`` it cannot run; ``signature``: what
    identifies its configuration in a convergence study's runs (:func:`run_signature`)."""
    ideal = self.ideal()
    self.table.append({"model": self.model_name, "row": row, "system": system, "config": config,
                       "objective": objective, "gpus": gpus, "images_per_sec": ips,
                       "throughput": None if ips is None else ips * self.per_example, "unit": self.unit,
                       "ideal_images_per_sec": ideal, "efficiency": None if ips is None else ips / ideal,
                       "ratio_to_best_peer": None, "goodput": NOT_TRAINED, "time_to_target_s": None,
                       "reason": reason, "signature": signature})
    if ips is None:
      common.progress("%s %s cannot run: %s", self.model_name, row, reason)
    else:
      common.progress("%s %s: %.1f %s/s", self.model_name, row, ips * self.per_example, self.unit)


def simulated_images_per_sec(s: Study, plans, d: int = 0, placement: str = "default", cluster=None) -> float:
  """Examples/s of ``plans`` on the ``sim`` executor, its trace checked by the WSP checker."""
  from hetpipe_jax.core.trace import Trace
  from hetpipe_jax.plan.layout import Layout
  from hetpipe_jax.sim import SimJob, SimOptions, simulate
  trace = Trace()
  seconds, vws, _ = simulate(SimJob(cluster or s.cluster, s.profiles, Layout(tuple(p.layout for p in plans)), d,
                                    FLAGS.waves, placement,
                                    options=SimOptions(overlap_transfers=FLAGS.overlap_transfers)), trace)
  common.require_wsp(trace.events, "simulated run")
  return sum(vw.completed for vw in vws) * s.batch / seconds


# The table.


def is_peer(entry: dict) -> bool:
  """Whether a table entry is a peer's: a registered system that is not a WSP one (HetPipe)."""
  system = systems().get(entry["system"])
  return system is not None and system.kind != WSP


def peer_entries(s: Study) -> None:
  """The systems of --systems, simulated with the knobs of the flags (experiments.peer_flags; --microbatches=0:
  the cluster's GPUs, as the convergence study sets them: the same configurations)."""
  knobs = peer_flags.knobs_from_flags(FLAGS, microbatches=FLAGS.microbatches or s.cluster.num_gpus)
  for spec in simulate_systems(FLAGS.systems, s.cluster, s.batch_profiles, s.batch, s.costs, knobs,
                               model=s.model_name, progress=lambda line: common.progress("%s", line)):
    name = spec.system.name
    if spec.run is None:
      s.entry(name, name, "", None, None, spec.reason)
      continue
    s.entry(name, name, spec.system.config(spec.run), spec.run.gpus, spec.run.images_per_sec,
            signature=spec.system.signature(spec.run))


def hetpipe_entries(s: Study, ds: list[int]) -> None:
  """HetPipe NP, ED, HD at every D: the planner's partitions and Nm, default placement."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.plan.allocation import plan_cluster
  for policy in POLICIES:
    try:
      plan = plan_cluster(s.cluster, s.profiles, policy, "default", "max_fit", None, s.costs)
    except ConfigError as e:
      for d in ds:
        s.entry(f"HetPipe {policy} D={d}", HETPIPE, "", None, None, str(e))
      continue
    config = f"{len(plan.vws)} virtual workers, Nm {[p.nm for p in plan.vws]}, default placement"
    for d in ds:
      s.entry(f"HetPipe {policy} D={d}", HETPIPE, config, s.cluster.num_gpus,
              simulated_images_per_sec(s, plan.vws, d, "default"), signature=[[p.nm for p in plan.vws], d])


def staleness_model(s: Study):
  """The staleness model of the first matching convergence file that has one (None: none)."""
  from hetpipe_jax.tune import StalenessModel
  for doc in s.convergence:
    fit = doc.get("staleness_model")
    if fit:
      return StalenessModel(fit["images0"], fit["beta"], fit.get("target_accuracy"))
  return None


def tuned_entries(s: Study, ds: list[int]) -> None:
  """HetPipe tuned, tuned for images/s, and tuned + outer (the tuned one's timing). The tuned rows are the
  configurations a matching convergence study chose and trained, when the tuner's search holds them (so their
  goodput marks are theirs); else the tuner's best by --tuned_objective and by images/s."""
  from hetpipe_jax import ConfigError
  fit = staleness_model(s) if FLAGS.tuned_objective == "time_to_accuracy" else None
  try:
    out = tuned_search(s, ds, fit)
  except ConfigError as e:
    for row in (TUNED, TUNED_IPS, TUNED_OUTER):
      s.entry(row, HETPIPE, "", None, None, str(e))
    return
  fastest = max(out.results, key=lambda r: r.images_per_sec)
  best, why = out.best, ("by predicted time to accuracy (staleness model of the convergence study)" if fit else
                         "by images/s" + ("" if FLAGS.tuned_objective == "throughput" else
                                          ": no staleness model from --convergence"))
  objective = "time_to_accuracy" if fit else "throughput"
  trained = [doc["tuned"] for doc in s.convergence if isinstance(doc.get("tuned"), dict) and doc["tuned"].get("label")]
  if trained:
    by_label = {r.candidate.label: r for r in out.results}
    chosen = by_label.get(trained[0]["label"])
    if chosen is not None:
      best, why, objective = chosen, f"as the convergence study chose it ({trained[0].get('objective')})", "study"
    fast = by_label.get((trained[0].get("fastest") or {}).get("label", ""))
    fastest = fast or fastest
  gpus = s.cluster.num_gpus
  s.notes.append(f"{TUNED} (+ outer): {why}: {best.candidate.label}")
  s.notes.append(f"{TUNED_IPS}: {fastest.candidate.label}")
  sign = lambda c: [[p.nm for p in c.plans], c.d]
  s.entry(TUNED, HETPIPE, best.candidate.label, gpus, best.images_per_sec, objective=objective,
          signature=sign(best.candidate))
  s.entry(TUNED_IPS, HETPIPE, fastest.candidate.label, gpus, fastest.images_per_sec, objective="throughput",
          signature=sign(fastest.candidate))
  s.entry(TUNED_OUTER, HETPIPE, f"as {TUNED}, + outer optimizer at the PS (same timing)", gpus,
          best.images_per_sec, objective=objective, signature=sign(best.candidate))


def tuned_search(s: Study, ds: list[int], fit):
  """The tuner's search (its best by images/s with ``fit`` None, else by predicted time to accuracy)."""
  from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune
  tune_ds = common.parse_ints("tune_ds", FLAGS.tune_ds) if FLAGS.tune_ds else ds
  what = "images/s" if fit is None else "time to accuracy"
  out = tune(s.cluster, s.profiles, s.batch, SearchSpace(ds=tuple(tune_ds), max_stages=FLAGS.max_stages or None),
             TuneOptions(waves=FLAGS.waves, staleness_model=fit, setting=RunSetting(s.costs), front=6,
                         progress=lambda line: common.progress("%s tuner (%s): %s", s.model_name, what, line)))
  common.progress("%s tuned by %s (%s): %.1f images/s", s.model_name, what, out.best.candidate.label,
                  out.best.images_per_sec)
  return out


def finish_table(s: Study) -> None:
  """Every entry's ratio to the best peer and goodput mark."""
  best_peer = s.best_peer()
  for e in s.table:
    if e["images_per_sec"] is not None and best_peer is not None:
      e["ratio_to_best_peer"] = e["images_per_sec"] / best_peer["images_per_sec"]
    e["goodput"], e["time_to_target_s"] = goodput(s.convergence, e["row"], e["signature"])


# Goodput: the convergence study's verdict on every row.


def convergence_docs(paths: Sequence[str]) -> list[dict]:
  """The convergence.json files of ``paths``, each with its ``path``.

  Raises:
    ConfigError: for a file that is missing or not a convergence.json.
  """
  import json

  from hetpipe_jax import ConfigError
  docs = []
  for path in paths:
    try:
      with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    except (OSError, ValueError) as e:
      raise ConfigError(f"--convergence={path}: {e}; give convergence.json files of experiments.convergence") from e
    if not isinstance(doc, dict) or "summary" not in doc or "time_axis" not in doc:
      raise ConfigError(f"--convergence={path} is not a convergence.json (no summary or time_axis); give files "
                        "experiments.convergence wrote")
    docs.append({**doc, "path": path})
  return docs


def convergence_paths() -> list[str]:
  """--convergence, or the default file where it exists."""
  if FLAGS.convergence is None:
    return [DEFAULT_CONVERGENCE] if os.path.exists(DEFAULT_CONVERGENCE) else []
  return [p for p in FLAGS.convergence if p]


def time_model_of(doc: dict) -> str | None:
  """The model of a convergence file's time axis ("cost model of vgg19 (batch 32) on paper_testbed")."""
  found = re.search(r"cost model of (\S+)", doc.get("time_axis", ""))
  return found[1] if found else None


def matches(doc: dict, model: str, cluster_name: str) -> bool:
  return time_model_of(doc) == model and doc.get("cluster") == cluster_name


def headline(s: Study) -> dict:
  """The fastest row that reaches the target (without convergence data: the fastest row), and the fastest."""
  ran = [e for e in s.table if e["images_per_sec"]]
  fastest = max(ran, key=lambda e: e["images_per_sec"], default=None)
  known = any(not e["goodput"].startswith(NOT_TRAINED) for e in s.table)
  best = max((e for e in ran if e["goodput"] == REACHES), key=lambda e: e["images_per_sec"], default=None)
  where = f"{s.model_name} on {s.cluster.name}"
  if not known:
    best = fastest
    note = (f"no convergence data for {where} (read: {', '.join(s.sources) or 'none'}); "
            f"goodput unknown: the fastest row, {describe(fastest)}")
  elif best is None:
    note = f"no row of {where} reaches the target in {', '.join(d['path'] for d in s.convergence)}"
  else:
    note = (f"the fastest row that reaches the target {target(s)}: {describe(best)}")
  return {"row": None if best is None else best["row"], "goodput_known": known,
          "images_per_sec": None if best is None else best["images_per_sec"],
          "throughput": None if best is None else best["throughput"], "unit": s.unit,
          "ratio_to_best_peer": None if best is None else best["ratio_to_best_peer"],
          "fastest": None if fastest is None else fastest["row"],
          "fastest_throughput": None if fastest is None else fastest["throughput"], "note": note}


def target(s: Study) -> str:
  values = sorted({d["target_accuracy"] for d in s.convergence if d.get("target_accuracy") is not None})
  return "/".join(f"{v:.4g}" for v in values) or "?"


def describe(e: dict | None) -> str:
  if e is None:
    return "none (no row ran)"
  ratio = "" if e["ratio_to_best_peer"] is None else f", {e['ratio_to_best_peer']:.2f}x the best peer"
  return f"{e['row']}, {e['throughput']:.1f} {e['unit']}/s{ratio}"


# The sub-studies.


def nm_rows(s: Study) -> None:
  """(a) one virtual worker, Nm = 1 .. nm_max."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.plan.allocation import allocate
  from hetpipe_jax.plan.partition import partition
  ed, hd, nodes = allocate(s.cluster, "ED")[0], allocate(s.cluster, "HD")[0], allocate(s.cluster, "NP")
  mixes = {"ED mix (1 of each type)": ed, "HD mix (fast + whimpy)": hd,
           f"one node ({nodes[0][0].type.name})": nodes[0]}
  for label, gpus in mixes.items():
    for nm in range(1, FLAGS.nm_max + 1):
      try:
        plan = partition(s.cluster, s.profiles, gpus, nm, s.costs)
      except ConfigError:
        break  # memory grows with Nm
      s.row("nm", label, len(gpus), nm, 0, simulated_images_per_sec(s, [plan]), s.ideal(gpus))
      common.progress("%s %s Nm=%d: %.1f images/s", s.model_name, label, nm, s.rows[-1]["images_per_sec"])


def closed_form_horovod(s: Study, study_name: str) -> None:
  """(b) the closed-form Horovod estimate on the GPUs that hold the model: its row (none when no GPU does)."""
  from hetpipe_jax.baselines.horovod import horovod_images_per_second
  from hetpipe_jax.plan.allocation import horovod_gpus
  gpus = horovod_gpus(s.cluster, s.profiles, s.costs)
  if gpus:
    ips = horovod_images_per_second(s.cluster, s.profiles, gpus, s.batch, overlap=False)
    s.row(study_name, f"Horovod (closed form), {len(gpus)} GPUs that hold the model", len(gpus), 1, 0, ips,
          s.ideal(), "serial")


def whimpy_rows(s: Study) -> bool:
  """(c) whimpy GPUs: HetPipe on the others, HetPipe on all (skipped when the cluster has no such GPUs or
  nothing else, or the model does not fit); whether it ran."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import make_cluster
  from hetpipe_jax.plan.allocation import plan_cluster
  cluster = s.cluster
  kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
          if cluster.node_gpus(n)[0].type.name != FLAGS.whimpy]
  if not kept or len(kept) == len({g.node for g in cluster.gpus}):
    common.progress("whimpy sub-study skipped: %s has no nodes of %s GPUs, or only those", cluster.name,
                    FLAGS.whimpy)
    return False
  without = make_cluster(f"{cluster.name}-no-whimpy", kept, cluster.intra_node, cluster.inter_node)
  for label, c in ((f"HetPipe ED-local, {without.num_gpus} GPUs (no {FLAGS.whimpy})", without),
                   (f"HetPipe ED-local, {cluster.num_gpus} GPUs", cluster)):
    try:
      plan = plan_cluster(c, s.profiles, "ED", "local", "max_fit", None, s.costs)
    except ConfigError as e:
      common.progress("whimpy sub-study skipped, %s: %s", label, e)
      return False
    s.row("whimpy", label, c.num_gpus, max(p.nm for p in plan.vws), 0,
          simulated_images_per_sec(s, plan.vws, 0, "local", c), s.ideal(cluster=c))
  return True


def study(model_name: str, cluster, ds: list[int], convergence: list[dict]) -> Study:
  """One model: the table (peers, HetPipe policies, tuned rows, goodput) and the sub-studies."""
  s = Study(model_name, cluster, convergence, [d["path"] for d in convergence])
  peer_entries(s)
  hetpipe_entries(s, ds)
  if FLAGS.tuned:
    tuned_entries(s, ds)
  finish_table(s)
  if "nm" in FLAGS.sub_studies:
    nm_rows(s)
  if "closed_form" in FLAGS.sub_studies:
    closed_form_horovod(s, "closed_form")
  if "whimpy" in FLAGS.sub_studies and whimpy_rows(s):
    closed_form_horovod(s, "whimpy")
  return s


# Output.


def table_chart(studies: list[Study], path: str) -> str:
  """One bar chart per model: peers and HetPipe rows coloured apart, rows that miss the target hatched and
  marked, rows that cannot run named, the ideal aggregate as a line."""
  from matplotlib.patches import Patch
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(studies), figsize=(7 * len(studies), 5), squeeze=False)
  for ax, s in zip(axes[0], studies):
    values = [e["throughput"] or 0.0 for e in s.table]
    colours = ["#999999" if is_peer(e) else "#4C72B0" for e in s.table]
    bars = ax.bar(range(len(values)), values, color=colours)
    top = max(values + [s.ideal() * s.per_example])
    for i, (bar, e) in enumerate(zip(bars, s.table)):
      if e["images_per_sec"] is None:
        ax.text(i, top * 0.02, "cannot run", rotation=90, ha="center", va="bottom", fontsize=7)
      elif e["goodput"] == MISSES:
        bar.set_hatch("//")
        bar.set_edgecolor("#C44E52")
        ax.text(i, values[i], "misses", ha="center", va="bottom", fontsize=7, color="#C44E52")
      elif e["goodput"] == REACHES:
        ax.text(i, values[i], "reaches", ha="center", va="bottom", fontsize=6, color="#55A868")
    ideal = s.ideal() * s.per_example
    ax.axhline(ideal, color="#C44E52", linestyle="--", linewidth=1)
    ax.text(-0.4, ideal, f"ideal aggregate {ideal:.0f}", ha="left", va="bottom", fontsize=7, color="#C44E52")
    ax.set_ylim(0, top * 1.1)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels([e["row"] for e in s.table], rotation=40, ha="right", fontsize=7)
    trained = any(not e["goodput"].startswith(NOT_TRAINED) for e in s.table)
    known = "" if trained else "; goodput unknown (no convergence data)"
    ax.set(title=f"{s.model_name} on {s.cluster.name} (batch {s.batch}){known}", ylabel=f"{s.unit}/s (simulated)")
    ax.grid(alpha=0.3, axis="y")
  fig.legend(handles=[Patch(color="#999999", label="peers"), Patch(color="#4C72B0", label="HetPipe"),
                      Patch(facecolor="white", edgecolor="#C44E52", hatch="//", label="misses the target")],
             fontsize=7, loc="lower left", ncol=3)
  return common.save_figure(fig, path)


def charts(rows: list[dict], out_dir: str) -> list[str]:
  """The sub-studies' charts: Nm sweep, whimpy GPUs."""
  plt = common.pyplot()
  paths = []
  models = list(dict.fromkeys(r["model"] for r in rows if r["study"] == "nm"))
  if models:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
      for config in dict.fromkeys(r["config"] for r in rows if r["model"] == model and r["study"] == "nm"):
        pts = [r for r in rows if r["model"] == model and r["study"] == "nm" and r["config"] == config]
        ax.plot([r["nm"] for r in pts], [r["images_per_sec"] for r in pts], "o-", label=config)
      ax.set(title=f"{model}: one virtual worker", xlabel="Nm", ylabel="examples/s (simulated)")
      ax.legend(fontsize=7)
      ax.grid(alpha=0.3)
    paths.append(common.save_figure(fig, os.path.join(out_dir, "throughput_nm.png")))
  models = list(dict.fromkeys(r["model"] for r in rows if r["study"] == "whimpy"))
  if models:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
      pts = [r for r in rows if r["model"] == model and r["study"] == "whimpy"]
      ax.bar(range(len(pts)), [r["images_per_sec"] for r in pts],
             color=["#999999" if r["config"].startswith("Horovod") else "#4C72B0" for r in pts])
      ax.set_xticks(range(len(pts)))
      ax.set_xticklabels([r["config"] for r in pts], rotation=30, ha="right", fontsize=7)
      ax.set(title=f"{model}: whimpy GPUs", ylabel="examples/s (simulated)")
      ax.grid(alpha=0.3, axis="y")
    paths.append(common.save_figure(fig, os.path.join(out_dir, "throughput_whimpy.png")))
  return paths


def print_rows(rows: list[dict]) -> None:
  """The sub-studies' rows."""
  if not rows:
    return
  print(f"{'model':10} {'study':11} {'config':52} {'GPUs':>4} {'Nm':>3} {'xfer':>7} {'ex./s':>9} {'ideal':>8} "
        f"{'eff.':>5}")
  for r in rows:
    print(f"{r['model']:10} {r['study']:11} {r['config'][:52]:52} {r['gpus']:>4} {r['nm']:>3} {r['transfers']:>7} "
          f"{r['images_per_sec']:9.1f} {r['ideal_images_per_sec']:8.1f} {r['efficiency']:5.2f}")
  print("sub-studies (outside the table): ideal is the sum of the standalone rates of the row's GPUs, eff. "
        "the examples/s over it")


def print_table(s: Study) -> None:
  """The model's table."""
  best = s.best_peer()
  sources = ", ".join(d["path"] for d in s.convergence) or "no matching convergence data"
  peer = "none runs" if best is None else f"{best['row']}, {best['throughput']:.1f} {s.unit}/s"
  print(f"\n{s.model_name} on {s.cluster.name}, batch {s.batch}: ideal aggregate {s.ideal() * s.per_example:.1f} "
        f"{s.unit}/s; best peer {peer}; goodput from {sources}")
  print(f"{'row':28} {'config':58} {'GPUs':>4} {s.unit + '/s':>10} {'eff.':>5} {'vs peer':>7} {'goodput':>11}")
  for e in s.table:
    if e["images_per_sec"] is None:
      print(f"{e['row']:28} cannot run: {e['reason']}")
      continue
    ratio = "-" if e["ratio_to_best_peer"] is None else f"{e['ratio_to_best_peer']:.2f}x"
    print(f"{e['row']:28} {e['config'][:58]:58} {e['gpus']:>4} {e['throughput']:10.1f} {e['efficiency']:5.2f} "
          f"{ratio:>7} {e['goodput']:>11}")
  for note in s.notes:
    print(note)


def print_headlines(studies: list[Study], heads: dict[str, dict]) -> None:
  print("eff.: over the ideal aggregate (the sum of every GPU's standalone rate); vs peer: over the best peer's "
        f"{'/'.join(sorted({s.unit for s in studies}))}/s; goodput: whether the row's training reached the target "
        "in the convergence study (every seed), missed it (some seed), or was not trained")
  print("simulated cluster (cost model: roofline with the calibrated catalogue's efficiency per GPU type and model "
        "family, links of the preset); not measured on GPUs")
  for s in studies:
    head = heads[s.model_name]
    table = {e["row"]: e for e in s.table}
    print(f"fastest overall, {s.model_name}: {describe(table.get(head['fastest']))}")
  for s in studies:
    print(f"headline, {s.model_name}: {heads[s.model_name]['note']}")


def main(argv):
  del argv
  from hetpipe_jax import get_cluster
  ds = common.parse_ints("ds", FLAGS.ds)
  if not ds or any(d < 0 for d in ds):
    raise common.config_error(f"--ds={','.join(FLAGS.ds)}; give one or more clock distance bounds D >= 0")
  if FLAGS.batch_size < 1 or FLAGS.gpt_batch_size < 0:
    raise common.config_error(f"--batch_size={FLAGS.batch_size}, --gpt_batch_size={FLAGS.gpt_batch_size}; give "
                              "a batch size >= 1 (--gpt_batch_size=0: --batch_size)")
  if set(FLAGS.sub_studies) - set(SUB_STUDIES):
    raise common.config_error(f"--sub_studies={','.join(FLAGS.sub_studies)}; choose among {', '.join(SUB_STUDIES)}")
  cluster = get_cluster(FLAGS.cluster)
  paths = convergence_paths()
  convergence = convergence_docs(paths)
  studies = [study(model, cluster, ds, convergence) for model in FLAGS.models]
  heads = {s.model_name: headline(s) for s in studies}
  rows = [r for s in studies for r in s.rows]
  doc = {"cluster": cluster.name, "tuned_objective": FLAGS.tuned_objective, "convergence": paths,
         "models": {s.model_name: {"unit": s.unit, "per_example": s.per_example, "batch_size": s.batch,
                                   "ideal_images_per_sec": s.ideal(), "best_peer": (s.best_peer() or {}).get("row"),
                                   "convergence": [d["path"] for d in s.convergence], "table": s.table,
                                   "headline": heads[s.model_name]} for s in studies},
         "rows": rows}
  outputs = [("json", common.write_json(common.output_path(FLAGS.out_dir, "throughput.json"), doc)),
             ("csv", common.write_dict_csv(common.output_path(FLAGS.out_dir, "throughput.csv"),
                                           [e for s in studies for e in s.table]))]
  if rows:
    outputs.append(("csv", common.write_dict_csv(common.output_path(FLAGS.out_dir, "throughput_rows.csv"), rows)))
  outputs.append(("chart", table_chart(studies, common.output_path(FLAGS.out_dir, "throughput_table.png"))))
  outputs += [("chart", p) for p in charts(rows, FLAGS.out_dir)]
  print_rows(rows)
  for s in studies:
    print_table(s)
  print_headlines(studies, heads)
  common.print_outputs(outputs, width=6)


cli = common.console(main)

if __name__ == "__main__":
  cli()
