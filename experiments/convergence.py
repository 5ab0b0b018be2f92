r"""Convergence study: HetPipe at several D and the tuned configuration against Horovod-style data
parallelism (and, with --ssp, an SSP parameter server).

Real training (real gradients, Fashion-MNIST by default) under the exact staleness pattern of an
emulated heterogeneous cluster. The default is the paper's setting: the time axis is VGG-19's cost on the
16-GPU testbed (--time_model; "none" times the trained model's own cost) while the numerics train the small
CNN, and the 12 -> 16 GPU comparison (--whimpy: the baselines may not use the RTX 2060s, HetPipe uses all
16). Every run sees the same examples (same epochs) from the same initialisation, for every seed of
--seeds:

* HetPipe at each D of --ds (allocation --policy, partitions and Nm from the planner), and the tuned
  configuration (``experiments.tune``'s search on the time model: grouping, Nm per virtual worker, D,
  placement, transfer model), chosen by its predicted time to accuracy with the staleness model fitted to
  the first seed's runs (--tuned_objective; images/s when they give no fit), or measured: --pilots
  configurations of the tuner's front of images/s against staleness trained on --pilot_seed, the first
  to the target chosen;
* Horovod-style synchronous data parallelism on the GPUs that hold the whole model (time per step:
  slowest GPU + all-reduce overlapped with the backward pass, the faster of the two baselines);
* with --ssp, an SSP parameter server without pipelining (one worker per GPU, Nm = 1, D = --ssp_d).

HetPipe and SSP runs train on the ``virtual`` executor, whose clock charges stage-to-stage transfers but
not the PS's pushes and pulls; their time axis is scaled so that each configuration's images/s equal the
``sim`` executor's for it (links shared, PS traffic, the configuration's transfer model), as the throughput
study measures it.

The time to --target_accuracy is when a run's test accuracy first reaches the target and stays there at
the next evaluation too (reached clearly, not a noisy peak). From the HetPipe runs that reach it, the
study fits the tuner's staleness-aware estimate (images to target = images0 x (1 + beta x mean staleness):
:class:`hetpipe_jax.staleness.StalenessModel`) and validates it leaving one run out at a time.

Writes convergence.json (every run with its ``seed``; the fitted ``staleness_model`` and its validation),
a CSV and PNG plots (test accuracy against emulated time and against epochs, mean over seeds with the
spread), prints each run's time to target (mean and range over seeds) and speedup over Horovod::

  python -m experiments.convergence
  python -m experiments.convergence --time_model=none --whimpy= --seeds=0 --out_dir=outputs/own_cost
  python -m experiments.convergence --tuned_objective=measured --pilots=6
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from absl import flags

from experiments import common

if TYPE_CHECKING:
  from hetpipe_jax import Cluster, Dataset, LayeredModel, RunConfig, RunResult
  from hetpipe_jax.cost.profile import UnitProfile

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "Model trained: mlp, cnn, vgg, resnet.")
flags.DEFINE_string("dataset", "auto", "auto (Fashion-MNIST, else digits), fashion_mnist, digits, synthetic.")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or .toml file.")
flags.DEFINE_string("policy", "ED", "HetPipe allocation policy: NP, ED, HD or a grouping.")
flags.DEFINE_list("ds", ["0", "4", "32"], "Clock distance bounds D of the HetPipe runs.")
flags.DEFINE_string("nm", "max_fit", "HetPipe Nm: max_fit, best or a number.")
flags.DEFINE_bool("tuned", True, "Add the tuned configuration (experiments.tune's search on the time model).")
flags.DEFINE_enum("tuned_objective", "time_to_accuracy", ["time_to_accuracy", "throughput", "measured"],
                  "What the tuned configuration optimises: predicted time to --target_accuracy (the staleness "
                  "model fitted to the first seed's runs; images/s when they give no fit), images/s, or measured "
                  "time to --target_accuracy (--pilots runs on --pilot_seed, of the tuner's configurations on its "
                  "images/s-staleness front).")
flags.DEFINE_integer("pilots", 4, "--tuned_objective=measured: how many configurations are trained to choose "
                     "the tuned one.")
flags.DEFINE_integer("pilot_seed", 100, "--tuned_objective=measured: the seed of the pilot runs (keep it out of "
                     "--seeds: the choice is then not fitted to the runs that judge it).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Initialisation and shuffling seeds: every run once per seed.")
flags.DEFINE_float("epochs", 0.7, "Training examples seen by every run, in epochs.")
flags.DEFINE_integer("batch_size", 32, "Minibatch size (per worker).")
flags.DEFINE_float("learning_rate", 0.02, "SGD learning rate of every run (0.05 made the 4-VW D=0 run and the "
                   "16-worker SSP run diverge).")
flags.DEFINE_float("target_accuracy", 0.70, "Test accuracy whose emulated time is the headline (reached when a "
                   "run reaches it and stays there at the next evaluation).")
flags.DEFINE_string("time_model", "vgg19", "vgg19 or resnet152: time axis from this model's cost on the cluster; "
                    "none: the trained model's own cost.")
flags.DEFINE_bool("ssp", False, "Add the SSP parameter-server baseline (one worker per GPU, Nm = 1).")
flags.DEFINE_integer("ssp_d", 4, "Staleness bound of the SSP baseline.")
flags.DEFINE_enum("horovod_lr_scale", "linear", ["linear", "none"], "Data-parallel learning rate: linear = "
                  "learning_rate x workers (its step averages their gradients; Goyal et al. 2017), none = "
                  "learning_rate.")
flags.DEFINE_string("whimpy", "RTX 2060", "GPU type the baselines may not use (the 12 -> 16 GPU experiment); "
                    "empty: they use every GPU that holds the model.")
flags.DEFINE_integer("eval_every", 5, "Evaluate every this many global clock ticks (baseline: steps).")
flags.DEFINE_string("out_dir", "outputs/convergence", "Where the JSON, CSV and plots go.")

OPTIMIZER = "sgd"  # every run's: HetPipe's local optimizer, the SSP workers' and the data-parallel step's


def time_to(curve: list[list[float]], target: float) -> float | None:
  """When the accuracy first reaches ``target`` and is still there at the next evaluation (or the run ends)."""
  for i, (t, _, acc, _) in enumerate(curve):
    if acc >= target and (i + 1 == len(curve) or curve[i + 1][2] >= target):
      return t
  return None


def images_to(curve: list[list[float]], target: float, batch_size: int) -> float | None:
  t = time_to(curve, target)
  return None if t is None else next(mbs for tt, mbs, _, _ in curve if tt == t) * batch_size


def hetpipe_curve(metrics: list[dict], nms: list[int], scale: float = 1.0) -> list[list[float]]:
  """[time x scale, minibatches so far (all workers), test accuracy, train loss] at every evaluation."""
  curve, done = [], 0
  for row in metrics:
    done += nms[row["vw"]]
    if "test_accuracy" in row:
      curve.append([row["time"] * scale, done, row["test_accuracy"], row["train_loss"]])
  return curve


class RunSpec(NamedTuple):
  """A HetPipe configuration of the study: its name, its :class:`~hetpipe_jax.RunConfig` fields (flat names),
  and the ``sim`` executor's transfer models for its time scale (which only that executor has)."""

  name: str
  fields: dict[str, Any]
  transfers: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Study:
  """What every run of the study shares, built once from the flags (:func:`make_study`)."""

  cluster: Cluster
  model: LayeredModel
  dataset: Dataset
  clock_profiles: list[UnitProfile]  # the time axis's cost model (--time_model, or the trained model's)
  time_axis: str
  base: RunConfig  # every run's config before its own fields
  policy: str | list[list[int]]
  nm: int | str
  slots: float  # the optimizer's slots, for memory
  sim_model: LayeredModel  # what the sim executor runs for a time scale
  sim_data: Any
  ds: list[int]
  total: int  # minibatches every run sees

  @property
  def epoch(self) -> float:
    """Minibatches per epoch."""
    return len(self.dataset.x_train) / FLAGS.batch_size


@dataclasses.dataclass
class Memo:
  """What runs reuse from earlier ones, passed to every step that reads or adds to it.

  Attributes:
    scales: configuration name -> its time scale to the sim executor (computed at its first run).
    reused: (seed, a run's fields but D) -> its runs whose gate never closed (at a larger D the run is the
      same, event for event).
  """

  scales: dict[str, float] = dataclasses.field(default_factory=dict)
  reused: dict[tuple[int, str], list[RunResult]] = dataclasses.field(default_factory=dict)


class Tuned(NamedTuple):
  """The tuned configuration: what it runs, the convergence.json ``tuned`` object, the pilot runs."""

  spec: RunSpec
  doc: dict[str, Any]
  pilots: list[dict[str, Any]]


def main(argv):
  del argv
  seeds, ds = check_flags()
  study = make_study(ds)
  runs, tuned = run_study(study, seeds, Memo())
  runs = [with_target(run) for run in runs]
  doc = study_doc(study, seeds, runs, tuned)
  paths = write_outputs(study, doc)
  report(doc, tuned)
  common.print_outputs(paths.items(), width=5)


def check_flags() -> tuple[list[int], list[int]]:
  """(seeds, ds) of the flags, refusing bad ones before anything runs."""
  from hetpipe_jax import ConfigError
  seeds = [common.check_seed(s, "seeds") for s in common.parse_ints("seeds", FLAGS.seeds)]
  if not seeds:
    raise ConfigError("--seeds is empty; give one or more seeds, e.g. --seeds=0,1,2")
  ds = common.parse_ints("ds", FLAGS.ds)
  if FLAGS.tuned and FLAGS.tuned_objective == "measured":
    if FLAGS.pilots < 1:
      raise ConfigError(f"--pilots={FLAGS.pilots}; --tuned_objective=measured needs at least 1 pilot run, e.g. "
                        "--pilots=4")
    if common.check_seed(FLAGS.pilot_seed, "pilot_seed") in seeds:
      raise ConfigError(f"--pilot_seed={FLAGS.pilot_seed} is one of --seeds; use a seed outside them, so that "
                        "the measured choice is not fitted to the runs that judge it")
  return seeds, ds


def make_study(ds: list[int]) -> Study:
  """The cluster, the trained model and data, the time axis and every run's base config, from the flags."""
  from hetpipe_jax import ConfigError, get_cluster
  cluster = get_cluster(FLAGS.cluster)
  common.ensure_devices(cluster.num_gpus)
  import jax
  import jax.numpy as jnp

  from hetpipe_jax import RunConfig, get_model, load_dataset
  from hetpipe_jax.cost.profile import full_size_profiles, profile_units
  from hetpipe_jax.models import FULL_SIZE, full_size_model
  from hetpipe_jax.optim import optimizer_slots
  from hetpipe_jax.plan.allocation import parse_policy

  time_model = None if FLAGS.time_model.lower() in ("", "none") else FLAGS.time_model
  if time_model is not None and time_model not in FULL_SIZE:
    raise ConfigError(f"--time_model={FLAGS.time_model}; use one of {', '.join(FULL_SIZE)} or none")
  dataset = load_dataset(FLAGS.dataset)
  model = get_model(FLAGS.model, dataset.num_classes)
  clock_profiles = (full_size_profiles(time_model, FLAGS.batch_size) if time_model else
                    profile_units(model, jax.ShapeDtypeStruct((FLAGS.batch_size,) + dataset.x_train.shape[1:],
                                                              jnp.float32)))
  time_axis = (f"cost model of {time_model} (batch {FLAGS.batch_size}) on {cluster.name}"
               if time_model else f"cost model of {model.name} on {cluster.name}")
  base = RunConfig.of(cluster=cluster, batch_size=FLAGS.batch_size, optimizer=OPTIMIZER,
                      learning_rate=FLAGS.learning_rate, eval_every=FLAGS.eval_every, time_model=time_model,
                      executor="virtual")
  sim_model, sim_data = ((full_size_model(time_model), FULL_SIZE[time_model]) if time_model else (model, dataset))
  return Study(cluster, model, dataset, clock_profiles, time_axis, base, parse_policy(FLAGS.policy),
               common.parse_nm(FLAGS.nm), optimizer_slots(OPTIMIZER), sim_model, sim_data, ds,
               total=int(FLAGS.epochs * len(dataset.x_train) / FLAGS.batch_size))


def run_study(study: Study, seeds: list[int], memo: Memo) -> tuple[list[dict], Tuned | None]:
  """Every run, seed by seed: HetPipe at every D, the tuned configuration (chosen once the first seed's
  runs are in), Horovod and (--ssp) SSP. The runs, and the tuned configuration (None: --notuned)."""
  specs = [RunSpec(f"HetPipe {FLAGS.policy} D={d}", {"policy": study.policy, "nm": study.nm, "d": d}, {})
           for d in study.ds]
  runs: list[dict] = []
  tuned: Tuned | None = None
  for seed in seeds:
    for spec in specs:
      runs.append(train(study, memo, spec, seed))
    if FLAGS.tuned:
      if tuned is None:
        tuned = tune_config(study, memo, runs)
      runs.append(train(study, memo, tuned.spec, seed))
    gpus = baseline_gpus(study)
    runs.append(horovod_run(study, gpus, seed))
    if FLAGS.ssp:
      runs.append(ssp_run(study, memo, gpus, seed))
  return runs, tuned


def sim_scale(study: Study, spec: RunSpec, waves: int, virtual_ips: float) -> float:
  """Emulated seconds on the sim executor (with ``spec``'s transfer models) per second of the virtual
  executor's clock."""
  from hetpipe_jax import run_hetpipe
  sim = run_hetpipe(study.sim_model, study.sim_data, study.base.replace(
      **spec.fields, **spec.transfers, time_model=None, executor="sim", waves=min(waves, 50)))
  common.require_wsp(sim.events, "simulated run")
  return virtual_ips / sim.images_per_second


def candidate_spec(name: str, candidate) -> RunSpec:
  """A tuner candidate as the study runs it: its settings as a run takes them (those of
  :func:`~hetpipe_jax.tune.candidate_json`), its transfer models for the sim executor's time scale."""
  from hetpipe_jax.tune import candidate_json
  settings = candidate_json(candidate)
  return RunSpec(name, {k: settings[k] for k in ("policy", "cuts", "nm", "window", "d", "placement")},
                 {k: settings[k] for k in ("overlap_transfers", "staged_ps")})


def train(study: Study, memo: Memo, spec: RunSpec, seed: int) -> dict:
  """One HetPipe run of ``spec`` on the virtual executor, its trace checked: the entry of the runs it makes."""
  from hetpipe_jax import staleness_stats
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import plan_cluster
  from hetpipe_jax.staleness import mean_staleness
  name, fields = spec.name, spec.fields
  if "cuts" in fields:
    layout_nms = fields["nm"]
  else:
    layout_nms = [p.nm for p in plan_cluster(study.cluster, study.clock_profiles, study.policy, "default", study.nm,
                                             None, CostContext(optimizer_slots=study.slots)).vws]
  waves = max(1, math.ceil(study.total / sum(layout_nms)))
  common.progress("seed %d, %s: %d virtual workers, Nm=%s, %d waves", seed, name, len(layout_nms), layout_nms,
                  waves)
  result = hetpipe_result(study, memo, spec, seed, waves)
  if name not in memo.scales:
    memo.scales[name] = sim_scale(study, spec, waves, result.images_per_second)
  nms = result.events[0]["nm"]
  run = {"name": name, "system": "hetpipe", "seed": seed, "d": fields["d"], "nm": nms,
         "gpus": sum(result.events[0]["stages"]), "time_scale": memo.scales[name],
         "curve": hetpipe_curve(result.metrics, nms, memo.scales[name]),
         "staleness": staleness_stats(result.events), "mean_staleness": mean_staleness(result.events)}
  run["time_to_target_s"] = time_to(run["curve"], FLAGS.target_accuracy)
  run["images_to_target"] = images_to(run["curve"], FLAGS.target_accuracy, FLAGS.batch_size)
  return run


def hetpipe_result(study: Study, memo: Memo, spec: RunSpec, seed: int, waves: int) -> RunResult:
  """The run of ``spec`` (``waves`` waves, ``seed``), or the same run at a smaller D whose gate never
  closed (at a larger D it is the same, event for event); its trace checked."""
  from hetpipe_jax import run_hetpipe
  name, fields = spec.name, spec.fields
  family = (seed, repr({k: v for k, v in fields.items() if k != "d"}))  # the same run but for D
  same = next((r for r in memo.reused.get(family, []) if r.events[0]["d"] < fields["d"]), None)
  if same is not None:
    common.progress("seed %d, %s: the same run as at D=%d (its gate never closed)", seed, name,
                    same.events[0]["d"])
    result = dataclasses.replace(same, events=[{**same.events[0], "d": fields["d"]}] + same.events[1:])
  else:
    result = run_hetpipe(study.model, study.dataset, study.base.replace(seed=seed, waves=waves, **fields))
  common.require_wsp(result.events, f"{name}, seed {seed}")
  if not any(e["ev"] == "wait" for e in result.events):
    memo.reused.setdefault(family, []).append(result)
  return result


def tune_config(study: Study, memo: Memo, runs: list[dict]) -> Tuned:
  """The tuner's best on the time model (--tuned_objective): by predicted time to accuracy with the
  staleness model fitted to ``runs`` (the first seed's; images/s when they give no fit), by images/s, or
  measured: the pilot runs' fastest to the target."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.staleness import fit_staleness_model
  from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune
  fit = None
  if FLAGS.tuned_objective != "throughput":
    points = [(r["mean_staleness"], r["images_to_target"]) for r in runs if r.get("images_to_target")]
    try:
      fit = fit_staleness_model(points, FLAGS.target_accuracy)
    except ConfigError as e:
      common.progress("ranking by images/s: %s", e)
  space = SearchSpace(ds=tuple(study.ds), max_stages=study.model.num_units)  # the trained model is cut over them
  options = TuneOptions(staleness_model=fit, front=0 if FLAGS.tuned_objective == "throughput" else 6,
                        setting=RunSetting(CostContext(optimizer_slots=study.slots)),
                        progress=lambda line: common.progress("tuner: %s", line))
  out = tune(study.cluster, study.clock_profiles, FLAGS.batch_size, space, options)
  best, pilots = out.best, []
  objective = "time_to_accuracy" if fit else "throughput"
  if FLAGS.tuned_objective == "measured":
    best, pilots = measured_best(study, memo, out.results, fit)
    objective = "measured"
  doc = {"objective": objective, "label": best.candidate.label, "images_per_sec": best.images_per_sec,
         "mean_staleness": best.staleness, "fit": None if fit is None else dataclasses.asdict(fit),
         "predicted_time_to_target_s": None if fit is None else fit.seconds(best.images_per_sec, best.staleness)}
  common.progress("tuned (%s): %s", doc["objective"], best.candidate.label)
  c = best.candidate
  return Tuned(candidate_spec(f"HetPipe tuned ({c.grouping}, D={c.d})", c), doc, pilots)


def measured_best(study: Study, memo: Memo, results: Sequence, fit) -> tuple[Any, list[dict]]:
  """Trains :func:`pilot_choices` of the tuner's results on --pilot_seed: the one that reached the target
  first (on the emulated clock), and the pilot runs' entries."""
  from hetpipe_jax import ConfigError
  chosen, front = pilot_choices(results, fit, FLAGS.pilots)
  common.progress("measured choice: %d pilot runs on seed %d, of %d configurations on the front", len(chosen),
                  FLAGS.pilot_seed, len(front))
  timed, pilots = [], []
  for i, r in enumerate(chosen):
    run = train(study, memo, candidate_spec(f"pilot {i + 1}: {r.candidate.label}", r.candidate), FLAGS.pilot_seed)
    pilots.append({"label": r.candidate.label, "images_per_sec": r.images_per_sec,
                   "mean_staleness_sim": r.staleness, "mean_staleness": run["mean_staleness"],
                   "predicted_time_to_target_s": None if fit is None else fit.seconds(r.images_per_sec,
                                                                                      r.staleness),
                   "time_to_target_s": run["time_to_target_s"], "images_to_target": run["images_to_target"],
                   "final_test_accuracy": run["curve"][-1][2], "seed": FLAGS.pilot_seed})
    common.progress("pilot %d/%d: %s: time to target %s", i + 1, len(chosen), r.candidate.label,
                    "not reached" if run["time_to_target_s"] is None else f"{run['time_to_target_s']:.4g} s")
    if run["time_to_target_s"] is not None:
      timed.append((run["time_to_target_s"], -r.images_per_sec, i, r))
  if not timed:
    raise ConfigError(f"none of the {len(chosen)} pilot runs reached {FLAGS.target_accuracy:.0%} within "
                      f"{FLAGS.epochs} epochs; lower --target_accuracy, raise --epochs or --pilots")
  return min(timed)[3], pilots


def baseline_gpus(study: Study) -> list:
  """The GPUs the baselines train on: those that hold the whole model, but --whimpy ones."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import horovod_gpus
  held = horovod_gpus(study.cluster, study.clock_profiles, CostContext(optimizer_slots=study.slots))
  gpus = [g for g in held if g.type.name != FLAGS.whimpy]
  if not gpus:
    raise ConfigError("no GPU of the cluster holds the whole model for the data-parallel baselines; use a "
                      "smaller --time_model or a cluster with larger GPUs")
  return gpus


def horovod_run(study: Study, gpus: list, seed: int) -> dict:
  """Horovod-style data parallelism on ``gpus``: the entry of the runs it makes."""
  from hetpipe_jax.baselines.data_parallel import train_data_parallel
  from hetpipe_jax.baselines.horovod import horovod_iteration_seconds
  from hetpipe_jax.optim import make_optimizer
  step_s = horovod_iteration_seconds(study.cluster, study.clock_profiles, gpus, overlap=True)
  lr = FLAGS.learning_rate * (len(gpus) if FLAGS.horovod_lr_scale == "linear" else 1)
  steps = study.total // len(gpus)
  common.progress("seed %d, Horovod on %d GPUs: %d steps", seed, len(gpus), steps)
  rows = train_data_parallel(study.model, study.dataset, make_optimizer(OPTIMIZER, lr), len(gpus), steps,
                             FLAGS.batch_size, step_s, seed, FLAGS.eval_every)
  return {"name": f"Horovod ({len(gpus)} GPUs)", "system": "horovod", "seed": seed, "d": 0, "nm": [1],
          "lr": lr, "gpus": len(gpus), "curve": [[r["time"], r["step"] * len(gpus), r["test_accuracy"],
                                                  r["train_loss"]] for r in rows if "test_accuracy" in r]}


def ssp_run(study: Study, memo: Memo, gpus: list, seed: int) -> dict:
  """An SSP parameter server without pipelining (a worker per GPU of ``gpus``, Nm = 1, D = --ssp_d): the
  entry of the runs it makes."""
  from hetpipe_jax import run_hetpipe, staleness_stats
  from hetpipe_jax.staleness import mean_staleness
  spec = RunSpec(f"SSP PS ({len(gpus)} GPUs) D={FLAGS.ssp_d}",
                 {"policy": [[g.index] for g in gpus], "nm": 1, "d": FLAGS.ssp_d}, {})
  name = spec.name
  ssp = run_hetpipe(study.model, study.dataset, study.base.replace(seed=seed, waves=max(1, study.total // len(gpus)),
                                                                   **spec.fields))
  common.require_wsp(ssp.events, f"{name}, seed {seed}")
  if name not in memo.scales:
    memo.scales[name] = sim_scale(study, spec, study.total // len(gpus), ssp.images_per_second)
  return {"name": name, "system": "ssp", "seed": seed, "d": FLAGS.ssp_d, "nm": [1], "gpus": len(gpus),
          "time_scale": memo.scales[name], "curve": hetpipe_curve(ssp.metrics, [1] * len(gpus), memo.scales[name]),
          "staleness": staleness_stats(ssp.events), "mean_staleness": mean_staleness(ssp.events)}


def with_target(run: dict) -> dict:
  """``run`` with its time and images to --target_accuracy and its final test accuracy."""
  return {**run, "time_to_target_s": time_to(run["curve"], FLAGS.target_accuracy),
          "images_to_target": images_to(run["curve"], FLAGS.target_accuracy, FLAGS.batch_size),
          "final_test_accuracy": run["curve"][-1][2]}


def study_doc(study: Study, seeds: list[int], runs: list[dict], tuned: Tuned | None) -> dict:
  """convergence.json: the setting, every configuration's summary over seeds, the tuned configuration, the
  fitted staleness model and its validation, every run."""
  names = list(dict.fromkeys(run["name"] for run in runs))
  summary = {name: summarise([r for r in runs if r["name"] == name]) for name in names}
  tuned_doc = {} if tuned is None else {**tuned.doc, **({"pilots": tuned.pilots} if tuned.pilots else {})}
  return {"target_accuracy": FLAGS.target_accuracy, "time_axis": study.time_axis, "model": study.model.name,
          "dataset": study.dataset.name, "cluster": study.cluster.name, "epochs": FLAGS.epochs,
          "whimpy": FLAGS.whimpy, "seeds": seeds, "summary": summary, "tuned": tuned_doc,
          **validate_staleness_model(runs, FLAGS.target_accuracy), "runs": runs}


def write_outputs(study: Study, doc: dict) -> dict[str, str]:
  """convergence.json, the CSV of every run's curve and the plot: kind -> path."""
  paths = {name: common.output_path(FLAGS.out_dir, f"convergence.{ext}")
           for name, ext in (("json", "json"), ("csv", "csv"), ("plot", "png"))}
  runs, epoch = doc["runs"], study.epoch
  common.write_json(paths["json"], doc)
  common.write_csv(paths["csv"], ["name", "system", "seed", "d", "time_s", "minibatches", "epochs", "test_accuracy",
                                  "train_loss"],
                   ([run["name"], run["system"], run["seed"], run["d"], t, mbs, mbs / epoch, acc, loss]
                    for run in runs for t, mbs, acc, loss in run["curve"]))
  plot(runs, epoch, paths["plot"], f"{study.model.name} on {study.dataset.name}; time: {study.time_axis}; "
       f"seeds {doc['seeds']}")
  return paths


def report(doc: dict, tuned: Tuned | None) -> None:
  """Prints every configuration's time to target and speedup over Horovod, the staleness, the fit, the
  tuned configuration's prediction, the best HetPipe run and the time axis."""
  summary = doc["summary"]
  horovod = next(name for name in summary if name.startswith("Horovod"))
  th = summary[horovod]["mean_time_to_target_s"]
  print_times(doc, th)
  print_staleness(doc)
  print_fit(doc)
  print_tuned(doc, tuned)
  print_best(doc, horovod, th)
  if th is None:
    print(f"the data-parallel baseline did not reach {FLAGS.target_accuracy:.0%} within {FLAGS.epochs} epochs for "
          "every seed: no mean speedup to report")
  print(f"time axis: {doc['time_axis']} (emulated seconds, not wall time)")


def print_times(doc: dict, th: float | None) -> None:
  """Every configuration's time to target (mean and range over seeds), final accuracy, speedup."""
  print(f"{'run':34} {'GPUs':>4} {'time to ' + format(FLAGS.target_accuracy, '.0%') + ' (mean, range)':>30} "
        f"{'final acc':>9} {'speedup vs Horovod':>20}")
  for name, s in doc["summary"].items():
    t = s["mean_time_to_target_s"]
    when = (f"{t:.4g} ({s['min_time_to_target_s']:.4g}..{s['max_time_to_target_s']:.4g})" if t is not None
            else f"not reached by {s['missed']} of {len(doc['seeds'])}")
    speed = f"{th / t:.2f}x ({(t - th) / th:+.0%} time)" if t and th else "-"
    print(f"{name:34} {s['gpus']:>4} {when:>30} {s['mean_final_test_accuracy']:9.4f} {speed:>20}")


def print_staleness(doc: dict) -> None:
  """Every configuration's mean and largest staleness, and its time scale to the sim executor."""
  for name in doc["summary"]:
    per_seed = [r for r in doc["runs"] if r["name"] == name]
    if "staleness" in per_seed[0]:
      stats = per_seed[0]["staleness"]
      print(f"{name}: mean staleness {sum(r['mean_staleness'] for r in per_seed) / len(per_seed):.2f}, global max "
            f"{max(r['staleness']['max_global_staleness'] or 0 for r in per_seed)} (bound "
            f"{max(stats['global_bound'])}); time axis x{per_seed[0]['time_scale']:.3f} to the sim executor")


def print_fit(doc: dict) -> None:
  """The fitted staleness-aware estimate and its leave-one-out error (or why there is none)."""
  fit = doc.get("staleness_model")
  if fit is None:
    print(f"staleness-aware estimate: not fitted ({doc['staleness_note']})")
    return
  check = doc["staleness_validation"]
  error = ("no run to leave out" if check["mean_abs_error"] is None else
           f"mean {check['mean_abs_error']:.1%}, worst {check['max_abs_error']:.1%} over {len(check['runs'])} runs")
  print(f"staleness-aware estimate: images to {FLAGS.target_accuracy:.0%} = {fit['images0']:.4g} x (1 + "
        f"{fit['beta']:.4g} x mean staleness); leave-one-out error on time to target: {error}")


def print_tuned(doc: dict, tuned: Tuned | None) -> None:
  """The pilot runs, and the tuned configuration's predicted time to target against the measured one."""
  info = doc["tuned"]
  for p in info.get("pilots", []):
    when = "not reached" if p["time_to_target_s"] is None else f"{p['time_to_target_s']:.4g} s"
    print(f"pilot (seed {p['seed']}): {p['label']}: {p['images_per_sec']:.1f} images/s, mean staleness "
          f"{p['mean_staleness']:.2f}, time to {FLAGS.target_accuracy:.0%} {when}")
  if tuned is None or info.get("predicted_time_to_target_s") is None:
    return
  measured = doc["summary"][tuned.spec.name]["mean_time_to_target_s"]
  how = ("the pilot runs" if info["objective"] == "measured" else
         "predicted time to " + format(FLAGS.target_accuracy, ".0%"))
  print(f"tuned by {how} ({info['label']}): the estimate predicted {info['predicted_time_to_target_s']:.4g} s "
        "before it ran, measured " + (f"{measured:.4g} s (mean over seeds)" if measured is not None else
                                      "not reached by every seed"))


def print_best(doc: dict, horovod: str, th: float | None) -> None:
  """The HetPipe configuration fastest to the target, as a fraction of Horovod's time (mean, per seed)."""
  summary, runs = doc["summary"], doc["runs"]
  best = min((n for n in summary if n.startswith("HetPipe") and summary[n]["mean_time_to_target_s"] is not None),
             key=lambda n: summary[n]["mean_time_to_target_s"], default=None)
  if best is None or not th:
    return
  ratios = [r["time_to_target_s"] / h["time_to_target_s"] for r in runs if r["name"] == best
            for h in runs if h["name"] == horovod and h["seed"] == r["seed"]
            if r["time_to_target_s"] is not None and h["time_to_target_s"] is not None]
  print(f"best HetPipe run: {best}, {summary[best]['mean_time_to_target_s'] / th:.2f} of Horovod's time to "
        f"target (mean over seeds); per seed {', '.join(f'{x:.2f}' for x in ratios)}")


def pilot_choices(results: Sequence, fit, count: int) -> tuple[list, list]:
  """``count`` configurations to train, and the front they come from: the tuner's results on the front of
  images/s against mean staleness (no other is both faster and less stale), one setting per grouping and
  Nm (its fastest). Half of them (rounded up) are the best by the staleness-aware estimate ``fit``, the
  others (all of them without a fit) evenly spaced inside the part of the front that is faster than those:
  more images/s for more staleness, the trade-off the estimate may judge wrongly."""
  from hetpipe_jax.tune import pareto_front
  best: dict[tuple, Any] = {}
  for r in pareto_front(results):  # in order of images/s: the last of a configuration is its fastest
    best[(r.candidate.grouping, tuple((p.nm, p.in_flight) for p in r.candidate.plans))] = r
  front = sorted(best.values(), key=lambda r: r.images_per_sec)
  chosen = []
  if fit is not None:
    chosen = sorted(front, key=lambda r: fit.seconds(r.images_per_sec, r.staleness))[:(count + 1) // 2]
  faster = [r for r in front if r.images_per_sec > max((c.images_per_sec for c in chosen), default=0.0)]
  n = count - len(chosen)
  chosen += list(dict.fromkeys(faster[(i + 1) * len(faster) // (n + 1)] for i in range(n))) if faster else []
  return chosen, front


def summarise(runs: list[dict]) -> dict:
  """Mean and range over seeds of one configuration's time to target and final accuracy."""
  times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
  reached = len(times) == len(runs)
  return {"gpus": runs[0]["gpus"], "seeds": [r["seed"] for r in runs], "missed": len(runs) - len(times),
          "mean_time_to_target_s": sum(times) / len(times) if reached else None,
          "min_time_to_target_s": min(times) if times else None, "max_time_to_target_s": max(times) if times else None,
          "mean_final_test_accuracy": sum(r["final_test_accuracy"] for r in runs) / len(runs)}


def validate_staleness_model(runs: list[dict], target_accuracy: float) -> dict:
  """Fits images to ``target_accuracy`` against mean staleness over the HetPipe and SSP runs that reached it,
  and validates the fit leaving one run out: the predicted time to target (images over the run's images/s)
  against the measured one."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.staleness import fit_staleness_model as fit
  points = [r for r in runs if "mean_staleness" in r and r["images_to_target"] is not None]
  try:
    model = fit([(r["mean_staleness"], r["images_to_target"]) for r in points], target_accuracy)
  except ConfigError as e:
    return {"staleness_note": str(e)}
  checks = []
  for i, r in enumerate(points):
    rest = points[:i] + points[i + 1:]
    try:
      held = fit([(x["mean_staleness"], x["images_to_target"]) for x in rest]) if rest else model
    except ConfigError:
      continue
    images_per_s = r["images_to_target"] / r["time_to_target_s"]
    predicted = held.seconds(images_per_s, r["mean_staleness"])
    checks.append({"name": r["name"], "seed": r["seed"], "measured_s": r["time_to_target_s"], "predicted_s": predicted,
                   "error": predicted / r["time_to_target_s"] - 1})
  errors = [abs(c["error"]) for c in checks]
  return {"staleness_model": {"images0": model.images0, "beta": model.beta, "target_accuracy": target_accuracy},
          "staleness_validation": {"runs": checks, "mean_abs_error": sum(errors) / len(errors) if errors else None,
                                   "max_abs_error": max(errors) if errors else None}}


def plot(runs: list[dict], epoch: float, path: str, title: str) -> None:
  """Test accuracy against emulated time and against epochs: per configuration the mean over seeds, and
  the band between the lowest and highest seed (every seed is evaluated at the same points)."""
  import numpy as np
  plt = common.pyplot()
  fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.2))
  for name in dict.fromkeys(run["name"] for run in runs):
    curves = [r["curve"] for r in runs if r["name"] == name]
    n = min(len(c) for c in curves)
    acc = np.array([[p[2] for p in c[:n]] for c in curves])
    style = "--" if runs[[r["name"] for r in runs].index(name)]["system"] != "hetpipe" else "-"
    for ax, x in ((ax_t, [p[0] for p in curves[0][:n]]), (ax_e, [p[1] / epoch for p in curves[0][:n]])):
      line, = ax.plot(x, acc.mean(axis=0), style, label=f"{name} ({len(curves)} seeds)")
      if len(curves) > 1:
        ax.fill_between(x, acc.min(axis=0), acc.max(axis=0), color=line.get_color(), alpha=0.15, lw=0)
  for ax in (ax_t, ax_e):
    ax.axhline(FLAGS.target_accuracy, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  ax_t.set(xlabel="emulated time (s)", ylabel="test accuracy (mean; band: seeds' range)")
  ax_e.set(xlabel="epochs", ylabel="test accuracy (mean; band: seeds' range)")
  fig.suptitle(title, fontsize=9)
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
