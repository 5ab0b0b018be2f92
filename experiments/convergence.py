r"""Convergence study: HetPipe (NP, ED, HD, the tuned configuration, and the tuned one with an outer optimizer
at the parameter server) against its peers (Horovod, heterogeneity-aware data parallelism, synchronous
heterogeneous pipelines, local SGD / DiLoCo) in time to accuracy.

Real training (real gradients, the MLP on Fashion-MNIST by default) on the emulated cluster's clock. The time axis is
the cost of --time_model (VGG-19 by default) on --cluster; "none" times the trained model's own cost. Every
run trains the same model from the same initialisation on the same examples (--epochs of them), once per
seed of --seeds:

* HetPipe with each allocation policy of --policies at each D of --ds (partitions and Nm from the planner),
  and the tuned configuration (``experiments.tune``'s search on the time model), chosen by measurement
  (--tuned_objective=measured, the default: --pilots configurations of the tuner's front of images/s against
  staleness trained on --pilot_seed, the first to the target kept), or by its predicted time to accuracy
  with the staleness model fitted to the first seed's HetPipe runs (images/s when they give no fit); with
  --outer, the tuned configuration again with that outer optimizer at the parameter server
  (``--ps_optimizer``: WSP with long waves as an asynchronous DiLoCo). They train on the ``virtual``
  executor, whose clock is scaled so that each configuration's images/s equal the ``sim`` executor's;
* every peer of --systems (:mod:`hetpipe_jax.baselines`), simulated on the same network and cost model
  (its round's seconds are its clock) and trained with its own numerics: horovod, hetero_dp and
  sync_pipeline as synchronous SGD at their global batch with each worker's gradient weighted by its share,
  local_sgd with its H and outer Nesterov step (--local_steps, --h_by_speed, --outer_lr, --outer_momentum);
* with --ssp, an SSP parameter server without pipelining (one worker per GPU, Nm = 1, D = --ssp_d).

Learning rates, the same rule for every system: the candidates are --base_lr (0.02) per 32-example update,
scaled linearly (--lr_scaling=sqrt: with the square root, for Adam) with the examples behind one update (a
synchronous peer's global batch; HetPipe's and local SGD's local step of one minibatch), times each factor
of --lr_grid; each system (HetPipe once, on its first policy's configuration; HetPipe with the outer
optimizer once more) trains every candidate on --pilot_seed (outside --seeds) for --lr_epochs epochs, and
keeps the one whose smoothed test accuracy ends highest; while the best is the grid's largest (smallest)
factor, the grid extends by one more step of the same ratio past it, up to 3 times.

Time to target: the test accuracy is smoothed by a trailing mean over --smooth evaluations (every
--eval_examples examples); a run reaches --target_accuracy at the first evaluation from which the smoothed
curve stays at or above it to the end. --target_accuracy=0 (the default) sets the target to 0.95 of the
best configuration's final smoothed accuracy (its mean over seeds). --full runs the study the goals are
measured on: 10 epochs, seeds 0, 1, 2 (learning-rate pilots of 1 epoch); the default is a shorter version
(2 epochs, seeds 0 and 1, pilots of 0.5 epochs) to stay quick.

Writes convergence.json (``target_accuracy``; every run with ``system``, ``name``, ``seed`` and
``time_to_target_s``, null when missed; the table; the learning rates and their pilots; the fitted
staleness model and its validation), a CSV of every curve and PNG plots, and prints one table: per
configuration images/s, efficiency against the ideal aggregate, its ratio to the best peer, the time to
target (mean, min, max over seeds) and the best peer's time over it. A language model's runs (the small GPT
on --dataset=tokens or text) report their test perplexity (exp of the mean test loss per token) against time
too: the CSV's ``test_perplexity`` column, each run's ``perplexity_curve`` ([time s, perplexity] at every
evaluation) and ``final_test_perplexity`` in the JSON, with the byte- (token-) unigram baseline
``unigram_test_perplexity`` (the training set's frequencies on the test set), a third plot panel and a
line per configuration::

  python -m experiments.convergence
  python -m experiments.convergence --full
  python -m experiments.convergence --model=gpt --dataset=text --optimizer=adam --lr_scaling=sqrt \
      --base_lr=0.001 --target_metric=loss --time_model=none --systems= --notuned --outer= --seeds=0 \
      --lr_grid=1 --policies=NP --cluster=hetero4 --epochs=3 --eval_examples=8000
  python -m experiments.convergence --time_model=resnet152 --out_dir=outputs/convergence_resnet152
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from absl import flags

from experiments import common, peer_flags
from hetpipe_jax.studies.convergence_target import Target, points
from hetpipe_jax.systems import (
  BASE_LR_PER_32,
  LR_SCALINGS,
  WSP,
  HetPipe,
  SystemSpec,
  TrainSetting,
  rule_lr,
  simulate_systems,
  systems,
)
from hetpipe_jax.systems.hetpipe import hetpipe_curve

if TYPE_CHECKING:
  from hetpipe_jax import Cluster, Dataset, LayeredModel, RunConfig, RunResult
  from hetpipe_jax.cost.profile import UnitProfile

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "Model trained: mlp (the default: its 32-example gradient costs 0.18 ms here, "
                    "the cnn's 29.6 ms, which makes a 3-epoch study of every configuration take hours), cnn, vgg, "
                    "resnet, gpt (--dataset=tokens or text).")
flags.DEFINE_string("dataset", "auto", "auto (Fashion-MNIST, else digits), fashion_mnist, digits, synthetic, "
                    "tokens (a synthetic language), text (English bytes: Debian's fortunes).")
flags.DEFINE_string("cluster", "paper_testbed", "Cluster preset or .toml file.")
flags.DEFINE_list("policies", ["NP", "ED", "HD"], "HetPipe allocation policies (NP, ED, HD or groupings).")
flags.DEFINE_list("ds", ["0"], "Clock distance bounds D of the HetPipe policy runs.")
flags.DEFINE_string("nm", "max_fit", "HetPipe Nm: max_fit, best or a number.")
flags.DEFINE_bool("tuned", True, "Add the tuned configuration (experiments.tune's search on the time model).")
flags.DEFINE_enum("tuned_objective", "measured", ["time_to_accuracy", "throughput", "measured"],
                  "What the tuned configuration optimises: predicted time to the target (the staleness model "
                  "fitted to the first seed's runs; images/s when they give no fit), images/s, or measured time "
                  "to the target (--pilots runs on --pilot_seed, of the tuner's configurations on its "
                  "images/s-staleness front).")
flags.DEFINE_integer("pilots", 4, "--tuned_objective=measured: how many configurations are trained to choose "
                     "the tuned one.")
flags.DEFINE_integer("pilot_seed", 100, "Seed of the pilot runs (learning rates, --tuned_objective=measured); keep "
                     "it out of --seeds, so that no choice is fitted to the runs that judge it.")
flags.DEFINE_string("outer", "nesterov:lr=0.7,momentum=0.9", "Outer optimizer at the PS of the extra tuned row "
                    "(--ps_optimizer syntax, lr on DiLoCo's scale: the server takes lr / N per push of N virtual "
                    "workers); empty: no such row.")
flags.DEFINE_list("systems", ["horovod", "hetero_dp", "sync_pipeline", "local_sgd"], "Peer systems "
                  "(hetpipe_jax.systems, and those --systems_module registers); their knobs: experiments.peer_flags "
                  "(--microbatches=0: the cluster's GPUs, the global batch of the data-parallel peers).")
peer_flags.override_defaults(h_by_speed=True)  # the study's one default of its own (experiments.peer_flags)
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "momentum", "adam"], "Every run's optimizer: HetPipe's local "
                  "one, the SSP workers', the peers' (local SGD's inner one). adam for a GPT, with --lr_scaling=sqrt.")
flags.DEFINE_float("base_lr", BASE_LR_PER_32, "The learning-rate rule's base: the rate of an update of 32 examples.")
flags.DEFINE_enum("lr_scaling", "linear", list(LR_SCALINGS), "How the rule scales --base_lr with the examples "
                  "of one update: linearly (SGD, Goyal et al. 2017) or with their square root (Adam, Malladi et "
                  "al. 2022).")
flags.DEFINE_list("lr_grid", ["0.5", "1", "2"], "Learning-rate factors tried per system around the rule's rate "
                  "(1 alone: no pilots).")
flags.DEFINE_float("lr_epochs", 0.5, "Epochs of each learning-rate pilot run.")
flags.DEFINE_list("seeds", ["0", "1"], "Initialisation and shuffling seeds: every run once per seed.")
flags.DEFINE_float("epochs", 2.0, "Training examples seen by every run, in epochs.")
flags.DEFINE_bool("full", False, "The study the goals are measured on: --epochs=10, --lr_epochs=1 and seeds 0, 1, "
                  "2 (where those flags are not given).")
flags.DEFINE_integer("batch_size", 32, "Minibatch size (per worker).")
flags.DEFINE_float("target_accuracy", 0.0, "Test accuracy (a test loss with --target_metric=loss) whose emulated "
                   "time is the headline; 0: 0.95 of the best configuration's final smoothed accuracy (mean over "
                   "seeds; a loss: the best final loss / 0.95).")
flags.DEFINE_enum("target_metric", "accuracy", ["accuracy", "loss"], "What the target is on: the test accuracy, or "
                  "the test loss (a language model: the small GPT on --dataset=tokens or text).")
flags.DEFINE_integer("smooth", 3, "Evaluations in the trailing mean of the smoothed accuracy curve.")
flags.DEFINE_integer("eval_examples", 6000, "Evaluate the test accuracy about every this many training examples.")
flags.DEFINE_string("time_model", "vgg19", "vgg19, resnet152 or another full-size model: time axis from this "
                    "model's cost on the cluster; none: the trained model's own cost.")
flags.DEFINE_bool("ssp", False, "Add the SSP parameter-server baseline (one worker per GPU, Nm = 1).")
flags.DEFINE_integer("ssp_d", 4, "Staleness bound of the SSP baseline.")
flags.DEFINE_string("whimpy", "", "GPU type the peers may not use (the paper's 12 -> 16 GPU experiment: "
                    "'RTX 2060'); empty: they use every GPU they can.")
flags.DEFINE_string("out_dir", "outputs/convergence", "Where the JSON, CSV and plots go.")

FULL = {"epochs": 10.0, "lr_epochs": 1.0, "seeds": [0, 1, 2]}  # --full
LR_EXTENSIONS = 3  # learning-rate pilots: how many steps the grid may extend past an edge that is best
HETPIPE, HETPIPE_OUTER = HetPipe.name, "hetpipe_outer"  # HetPipe's learning-rate systems (without, with --outer)


def target_rule() -> Target:
  """What the target is on and how it is smoothed (--target_metric, --smooth)."""
  return Target(FLAGS.target_metric, FLAGS.smooth)


def is_peer(system: str) -> bool:
  """Whether ``system`` (a run's) is a peer: a registered system that is not a WSP one (HetPipe; SSP is none)."""
  known = systems().get(system)
  return known is not None and known.kind != WSP


class RunSpec(NamedTuple):
  """A HetPipe configuration of the study: its name, its :class:`~hetpipe_jax.RunConfig` fields (flat names),
  the ``sim`` executor's transfer models for its time scale (which only that executor has), its row in the
  table (the key the throughput study matches) and its learning-rate system."""

  name: str
  fields: dict[str, Any]
  transfers: dict[str, Any]
  row: str = ""
  lr_system: str = HETPIPE


@dataclasses.dataclass(frozen=True)
class Study:
  """What every run of the study shares, built once from the flags (:func:`make_study`)."""

  cluster: Cluster
  model: LayeredModel
  dataset: Dataset
  clock_profiles: list[UnitProfile]  # the time axis's cost model (--time_model, or the trained model's)
  time_axis: str
  base: RunConfig  # every HetPipe run's config before its own fields
  policies: list[str | list[list[int]]]
  nm: int | str
  slots: float  # the optimizer's slots, for memory
  sim_model: LayeredModel  # what the sim executor runs for a time scale
  sim_data: Any
  ds: list[int]
  total: int  # minibatches every run sees
  peers: list[SystemSpec]  # one per --systems
  knobs: Any  # the peers' PeerKnobs
  ideal: float  # the ideal heterogeneous aggregate of the cluster on the time model
  per_example: int  # what one example counts as in throughput: a GPT time model's tokens per sequence, else 1
  unit: str  # "tokens" or "images"
  not_run: dict[str, str]  # row -> why it cannot run on this cluster (a peer, or a policy no partition fits)

  @property
  def language(self) -> bool:
    """Whether the trained model is a language model (labels: the next tokens), whose perplexity is reported."""
    return self.dataset.y_train.ndim == 2

  @property
  def epoch(self) -> float:
    """Minibatches per epoch."""
    return len(self.dataset.x_train) / FLAGS.batch_size

  def policy_specs(self) -> list[RunSpec]:
    """HetPipe at every policy of --policies and every D of --ds."""
    specs = []
    for policy in self.policies:
      label = policy if isinstance(policy, str) else "/".join(",".join(map(str, g)) for g in policy)
      for d in self.ds:
        name = f"HetPipe {label} D={d}"
        specs.append(RunSpec(name, {"policy": policy, "nm": self.nm, "d": d}, {}, name))
    return specs


@dataclasses.dataclass
class Memo:
  """What runs reuse from earlier ones, passed to every step that reads or adds to it.

  Attributes:
    scales: configuration name -> its time scale to the sim executor (computed at its first run).
    images: configuration name -> the sim executor's images/s for it.
    reused: (seed, a run's fields but D) -> its runs whose gate never closed (at a larger D the run is the
      same, event for event).
    lrs: learning-rate system -> the chosen learning rate; pilots: their pilot runs.
  """

  scales: dict[str, float] = dataclasses.field(default_factory=dict)
  images: dict[str, float] = dataclasses.field(default_factory=dict)
  reused: dict[tuple[int, str], list[RunResult]] = dataclasses.field(default_factory=dict)
  lrs: dict[str, float] = dataclasses.field(default_factory=dict)
  pilots: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class Tuned(NamedTuple):
  """The tuned configurations: what they run, the convergence.json ``tuned`` object, the pilot runs."""

  specs: list[RunSpec]
  doc: dict[str, Any]
  pilots: list[dict[str, Any]]


def main(argv):
  del argv
  seeds, ds = check_flags()
  study = make_study(ds)
  memo = Memo()
  choose_learning_rates(study, memo)
  runs, tuned = run_study(study, seeds, memo)
  target = FLAGS.target_accuracy or target_of(runs)
  runs = [with_target(run, target) for run in runs]
  if study.language:
    runs = [with_perplexity(run) for run in runs]
  doc = study_doc(study, seeds, runs, tuned, target, memo)
  paths = write_outputs(study, doc)
  report(doc, tuned)
  common.print_outputs(paths.items(), width=5)


def check_flags() -> tuple[list[int], list[int]]:
  """(seeds, ds) of the flags (--full applied), refusing bad ones before anything runs."""
  from hetpipe_jax import ConfigError
  if FLAGS.full:  # (a flag given on the command line keeps its value)
    for name, value in FULL.items():
      if not FLAGS[name].present:
        FLAGS[name].value = [str(x) for x in value] if isinstance(value, list) else value
  seeds = [common.check_seed(s, "seeds") for s in common.parse_ints("seeds", FLAGS.seeds)]
  if not seeds:
    raise ConfigError("--seeds is empty; give one or more seeds, e.g. --seeds=0,1,2")
  ds = common.parse_ints("ds", FLAGS.ds)
  if not ds or any(d < 0 for d in ds):
    raise ConfigError(f"--ds={','.join(FLAGS.ds)}; give one or more clock distance bounds D >= 0")
  for name, value, ok, limit in (("epochs", FLAGS.epochs, FLAGS.epochs > 0, "> 0"),
                                 ("lr_epochs", FLAGS.lr_epochs, FLAGS.lr_epochs > 0, "> 0"),
                                 ("smooth", FLAGS.smooth, FLAGS.smooth >= 1, ">= 1"),
                                 ("eval_examples", FLAGS.eval_examples, FLAGS.eval_examples >= 1, ">= 1"),
                                 ("target_accuracy", FLAGS.target_accuracy, FLAGS.target_accuracy >= 0 and (
                                     FLAGS.target_metric == "loss" or FLAGS.target_accuracy <= 1),
                                  "in [0, 1] for an accuracy, >= 0 for a loss (0: automatic)")):
    if not (ok and math.isfinite(value)):
      raise ConfigError(f"--{name}={value}; give {limit}")
  grid = [float(x) for x in FLAGS.lr_grid] if all(_is_number(x) for x in FLAGS.lr_grid) else []
  if not grid or any(not (math.isfinite(x) and x > 0) for x in grid):
    raise ConfigError(f"--lr_grid={','.join(FLAGS.lr_grid)}; give one or more factors > 0, e.g. 0.5,1,2")
  if common.check_seed(FLAGS.pilot_seed, "pilot_seed") in seeds:
    raise ConfigError(f"--pilot_seed={FLAGS.pilot_seed} is one of --seeds; use a seed outside them, so that no "
                      "choice is fitted to the runs that judge it")
  if FLAGS.tuned and FLAGS.tuned_objective == "measured" and FLAGS.pilots < 1:
    raise ConfigError(f"--pilots={FLAGS.pilots}; --tuned_objective=measured needs at least 1 pilot run, e.g. "
                      "--pilots=4")
  return seeds, ds


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def make_study(ds: list[int]) -> Study:
  """The cluster, the trained model and data, the time axis, the peers and every run's base config."""
  from hetpipe_jax import ConfigError, get_cluster
  from hetpipe_jax.optim import make_ps_optimizer
  cluster = get_cluster(FLAGS.cluster)
  common.ensure_devices(cluster.num_gpus)
  import jax

  from hetpipe_jax import RunConfig, get_model, load_dataset
  from hetpipe_jax.cost.batch import BatchProfiles
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.cost.profile import profile_units
  from hetpipe_jax.models import FULL_SIZE, full_size_input, full_size_model
  from hetpipe_jax.optim import optimizer_slots
  from hetpipe_jax.plan.allocation import parse_policy
  from hetpipe_jax.plan.costmodel import ideal_images_per_sec

  time_model = None if FLAGS.time_model.lower() in ("", "none") else FLAGS.time_model
  if time_model is not None and time_model not in FULL_SIZE:
    raise ConfigError(f"--time_model={FLAGS.time_model}; use one of {', '.join(FULL_SIZE)} or none")
  if FLAGS.outer:
    make_ps_optimizer(FLAGS.outer)  # refused before anything runs
  dataset = load_dataset(FLAGS.dataset)
  model = get_model(FLAGS.model, dataset.num_classes)
  b = FLAGS.batch_size
  sample = lambda n: jax.ShapeDtypeStruct((n,) + dataset.x_train.shape[1:], dataset.x_train.dtype)
  profiles = (BatchProfiles.full_size(time_model, b) if time_model else
              BatchProfiles(tuple(profile_units(model, sample(b))), tuple(profile_units(model, sample(2 * b))), b,
                            2 * b))
  clock_profiles = list(profiles.at(b))
  per_example = full_size_input(time_model, 1).shape[1] if time_model and time_model.startswith("gpt") else 1
  time_axis = (f"cost model of {time_model} (batch {b}) on {cluster.name}" if time_model
               else f"cost model of {model.name} on {cluster.name}")
  base = RunConfig.of(cluster=cluster, batch_size=b, optimizer=FLAGS.optimizer, time_model=time_model,
                      executor="virtual")
  sim_model, sim_data = ((full_size_model(time_model), FULL_SIZE[time_model]) if time_model else (model, dataset))
  slots = optimizer_slots(FLAGS.optimizer)
  knobs = peer_flags.knobs_from_flags(FLAGS, microbatches=FLAGS.microbatches or cluster.num_gpus)
  peers = simulate_systems(FLAGS.systems, cluster, profiles, b, CostContext(optimizer_slots=slots), knobs,
                           FLAGS.whimpy, time_model or model.name, lambda line: common.progress("%s", line))
  policies, not_run = plannable([parse_policy(p) for p in FLAGS.policies], cluster, clock_profiles, slots,
                                model.num_units)
  not_run.update({p.system.name: str(p.reason) for p in peers if p.run is None})
  return Study(cluster, model, dataset, clock_profiles, time_axis, base, policies,
               common.parse_nm(FLAGS.nm), slots, sim_model, sim_data, ds,
               int(FLAGS.epochs * len(dataset.x_train) / b), peers, knobs,
               ideal_images_per_sec(cluster, clock_profiles, b), per_example,
               "tokens" if per_example > 1 else "images", not_run)


def plannable(policies: list, cluster, profiles, slots: float, num_units: int) -> tuple[list, dict[str, str]]:
  """The policies the planner can lay out on ``cluster`` (memory) with virtual workers of at most
  ``num_units`` GPUs (the trained model is cut over them), and why each other one cannot run.

  Raises:
    ConfigError: when none can.
  """
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import plan_cluster
  kept, reasons = [], {}
  for policy in policies:
    try:
      plan = plan_cluster(cluster, profiles, policy, "default", common.parse_nm(FLAGS.nm), None,
                          CostContext(optimizer_slots=slots))
      widest = max(len(vw.stages) for vw in plan.vws)
      if widest > num_units:
        raise ConfigError(f"its virtual workers have {widest} GPUs, and the trained model has only {num_units} "
                          "units to cut over them; train a deeper model (--model) or use other --policies")
      kept.append(policy)
    except ConfigError as e:
      reasons[f"HetPipe {policy}"] = str(e)
  if not kept:
    raise ConfigError(f"no policy of --policies={','.join(FLAGS.policies)} fits cluster {cluster.name!r}: "
                      f"{next(iter(reasons.values()))}")
  return kept, reasons


def choose_learning_rates(study: Study, memo: Memo) -> None:
  """The learning rate of every system by the rule of the module docstring, into ``memo.lrs`` (the pilot runs
  into ``memo.pilots``)."""
  grid = [float(x) for x in FLAGS.lr_grid]
  hetpipe = study.policy_specs()[0]
  rule = lambda examples: rule_lr(examples, FLAGS.base_lr, FLAGS.lr_scaling)
  systems: list[tuple[str, float, Any]] = [(p.system.name, rule(p.update_examples), p) for p in study.peers
                                           if p.run is not None]
  systems.append((HETPIPE, rule(FLAGS.batch_size), hetpipe))
  if FLAGS.outer:
    spec = outer_spec(len(plan_nms(study, hetpipe)))
    outer = hetpipe._replace(name=f"{hetpipe.name} + {spec}", fields={**hetpipe.fields, "ps_optimizer": spec},
                             lr_system=HETPIPE_OUTER)
    systems.append((HETPIPE_OUTER, rule(FLAGS.batch_size), outer))
  for system, base, what in systems:
    if len(grid) == 1:
      memo.lrs[system] = base * grid[0]
      continue
    scores: dict[float, float] = {}
    factors = sorted(grid)
    for _ in range(LR_EXTENSIONS + 1):  # the grid, then one step further while the best is at an edge
      for factor in factors:
        if factor not in scores:
          scores[factor] = lr_pilot(study, memo, system, what, base, factor)
      best = max(scores, key=lambda f: (scores[f], -f))  # the highest final accuracy; a tie: the smaller rate
      ends = sorted(scores)
      if scores[best] == -math.inf or best not in (ends[0], ends[-1]):
        break
      factors = [best * (ends[-1] / ends[-2] if best == ends[-1] else ends[0] / ends[1])]
    memo.lrs[system] = base * best
    common.progress("learning rate of %s: %.4g", system, memo.lrs[system])


def lr_pilot(study: Study, memo: Memo, system: str, what: Any, base: float, factor: float) -> float:
  """One learning-rate pilot of ``system`` at ``base`` x ``factor``: its score (the final smoothed accuracy;
  -inf when it diverged), recorded in ``memo.pilots``."""
  lr, rule = base * factor, target_rule()
  curve = pilot_curve(study, memo, what, lr)
  memo.pilots.append({"system": system, "lr": lr, "factor": factor, "seed": FLAGS.pilot_seed,
                      "epochs": FLAGS.lr_epochs, "final_smoothed": rule.final(curve) if curve else None,
                      "diverged": not curve})
  common.progress("learning rate of %s: %.4g (x%g) ends at %s", system, lr, factor,
                  f"{rule.final(curve):.4f}" if curve else "divergence")
  return rule.better(rule.final(curve)) if curve else -math.inf


def outer_spec(num_vws: int) -> str:
  """--outer for a configuration of ``num_vws`` virtual workers: its learning rate is DiLoCo's, one step on the
  mean of the workers' changes per round; every push of WSP takes its own step, so the server's rate per push
  is that over ``num_vws``."""
  from hetpipe_jax.optim import parse_ps_optimizer
  parsed = parse_ps_optimizer(FLAGS.outer)
  return str(parsed._replace(lr=parsed.lr / num_vws)) if parsed.name != "add" else str(parsed)


def plan_nms(study: Study, spec: RunSpec) -> list[int]:
  """Nm of every virtual worker of ``spec`` (planned for a policy)."""
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import plan_cluster
  fields = spec.fields
  if "cuts" in fields:
    return list(fields["nm"])
  return [p.nm for p in plan_cluster(study.cluster, study.clock_profiles, fields["policy"], "default", study.nm, None,
                                     CostContext(optimizer_slots=study.slots)).vws]


def pilot_curve(study: Study, memo: Memo, what: Any, lr: float) -> list[list[float]] | None:
  """A learning-rate pilot: ``what`` (a peer or a HetPipe configuration) trained on --pilot_seed for
  --lr_epochs epochs at ``lr``; None when it diverged."""
  from hetpipe_jax.errors import RunStopped
  try:
    if isinstance(what, RunSpec):
      return train(study, memo, what, FLAGS.pilot_seed, lr, FLAGS.lr_epochs)["curve"]
    return train_system(study, what, FLAGS.pilot_seed, lr, FLAGS.lr_epochs)
  except RunStopped as e:
    common.progress("pilot at learning rate %.4g stopped: %s", lr, e)
    return None


def run_study(study: Study, seeds: list[int], memo: Memo) -> tuple[list[dict], Tuned | None]:
  """Every run, seed by seed: the peers, HetPipe at every policy and D, the tuned configurations (chosen once
  the first seed's runs are in) and (--ssp) SSP. The runs, and the tuned configurations (None: --notuned)."""
  runs: list[dict] = []
  tuned: Tuned | None = None
  for seed in seeds:
    runs += [peer_run(study, p, seed, memo.lrs[p.system.name]) for p in study.peers if p.run is not None]
    for spec in study.policy_specs():
      runs.append(train(study, memo, spec, seed, memo.lrs[HETPIPE]))
    if FLAGS.tuned:
      if tuned is None:
        tuned = tune_config(study, memo, runs)
      runs += [train(study, memo, spec, seed, memo.lrs[spec.lr_system]) for spec in tuned.specs]
    if FLAGS.ssp:
      runs.append(ssp_run(study, memo, seed))
  return runs, tuned


def train_system(study: Study, spec: SystemSpec, seed: int, lr: float, epochs: float) -> list:
  """``spec``'s system trained with its own numerics for ``epochs`` epochs: its curve."""
  setting = TrainSetting(seed, lr, FLAGS.optimizer, epochs, FLAGS.eval_examples, FLAGS.batch_size)
  return spec.system.train(study.model, study.dataset, spec.simulated, setting, study.knobs)


def peer_run(study: Study, spec: SystemSpec, seed: int, lr: float) -> dict:
  """One peer's run with its numerics: the entry of the runs it makes."""
  common.progress("seed %d, %s: %d workers, batches %s, H %s, learning rate %.4g", seed, spec.name,
                  len(spec.batch_sizes), spec.batch_sizes, spec.local_steps, lr)
  curve = train_system(study, spec, seed, lr, FLAGS.epochs)
  run, name = spec.simulated, spec.system.name
  return {"name": spec.name, "row": name, "system": name, "seed": seed, "d": 0, "nm": [1],
          "lr": lr, "gpus": run.gpus, "global_batch": sum(spec.batch_sizes),
          "batch_sizes": spec.batch_sizes, "local_steps": spec.local_steps, "round_seconds": run.round_seconds,
          "images_per_sec": run.images_per_sec, "efficiency": run.efficiency, "curve": curve}


def sim_rate(study: Study, spec: RunSpec, waves: int) -> float:
  """The sim executor's images/s of ``spec`` (its transfer models; the trace checked)."""
  from hetpipe_jax import run_hetpipe
  fields = {k: v for k, v in spec.fields.items() if k != "ps_optimizer"}  # (the outer optimizer: no time)
  sim = run_hetpipe(study.sim_model, study.sim_data, study.base.replace(
      **fields, **spec.transfers, time_model=None, executor="sim", waves=min(waves, 50)))
  common.require_wsp(sim.events, "simulated run")
  return sim.images_per_second


def candidate_spec(name: str, row: str, candidate, extra: dict | None = None) -> RunSpec:
  """A tuner candidate as the study runs it: its settings as a run takes them (those of
  :func:`~hetpipe_jax.tune.candidate_json`), its transfer models for the sim executor's time scale."""
  from hetpipe_jax.tune import candidate_json
  settings = candidate_json(candidate)
  return RunSpec(name, {**{k: settings[k] for k in ("policy", "cuts", "nm", "window", "d", "placement")},
                        **(extra or {})},
                 {k: settings[k] for k in ("overlap_transfers", "staged_ps")}, row,
                 HETPIPE_OUTER if extra and "ps_optimizer" in extra else HETPIPE)


def train(study: Study, memo: Memo, spec: RunSpec, seed: int, lr: float, epochs: float | None = None) -> dict:
  """One HetPipe run of ``spec`` at learning rate ``lr`` on the virtual executor (--epochs, or ``epochs``), its
  trace checked: the entry of the runs it makes."""
  from hetpipe_jax import staleness_stats
  from hetpipe_jax.staleness import mean_staleness
  name, fields = spec.name, spec.fields
  layout_nms = plan_nms(study, spec)
  total = study.total if epochs is None else int(epochs * study.epoch)
  waves = max(1, math.ceil(total / sum(layout_nms)))
  eval_every = max(1, round(FLAGS.eval_examples / (sum(layout_nms) * FLAGS.batch_size)))
  common.progress("seed %d, %s: %d virtual workers, Nm=%s, %d waves, learning rate %.4g", seed, name,
                  len(layout_nms), layout_nms, waves, lr)
  result = hetpipe_result(study, memo, spec, seed, waves, {"learning_rate": lr, "eval_every": eval_every})
  if name not in memo.scales:
    memo.images[name] = sim_rate(study, spec, waves)
    memo.scales[name] = result.images_per_second / memo.images[name]
  nms = result.events[0]["nm"]
  return {"name": name, "row": spec.row, "system": HETPIPE, "seed": seed, "d": fields["d"], "nm": nms, "lr": lr,
          "gpus": sum(result.events[0]["stages"]), "time_scale": memo.scales[name],
          "images_per_sec": memo.images[name], "efficiency": memo.images[name] / study.ideal,
          "ps_optimizer": fields.get("ps_optimizer", "add"),
          "curve": hetpipe_curve(result.metrics, nms, memo.scales[name]),
          "staleness": staleness_stats(result.events), "mean_staleness": mean_staleness(result.events)}


def hetpipe_result(study: Study, memo: Memo, spec: RunSpec, seed: int, waves: int, extra: dict) -> RunResult:
  """The run of ``spec`` (``waves`` waves, ``seed``, the ``extra`` fields), or the same run at a smaller D whose
  gate never closed (at a larger D it is the same, event for event); its trace checked."""
  from hetpipe_jax import run_hetpipe
  name, fields = spec.name, {**spec.fields, **extra}
  family = (seed, repr({k: v for k, v in fields.items() if k != "d"}) + f" waves={waves}")  # the same run but D
  same = next((r for r in memo.reused.get(family, []) if r.events[0]["d"] < fields["d"]), None)
  if same is not None:
    common.progress("seed %d, %s: the same run as at D=%d (its gate never closed)", seed, name,
                    same.events[0]["d"])
    result = dataclasses.replace(same, events=[{**same.events[0], "d": fields["d"]}] + same.events[1:])
  else:
    result = run_hetpipe(study.model, study.dataset, study.base.replace(seed=seed, waves=waves, **fields))
  common.require_wsp(result.events, f"{name}, seed {seed}")
  if not any(e["ev"] == "wait" for e in result.events):
    # kept without its virtual workers: their compiled programs would stay mapped (a 64-GPU study's runs
    # exceed the kernel's 65,530 memory maps of a process), and only the trace, metrics and clock are reused
    memo.reused.setdefault(family, []).append(dataclasses.replace(result, vws=[], init_params=None, params=None))
  gc.collect()  # the run's programs freed now, not when the collector next runs
  return result


def provisional_target(runs: list[dict]) -> float:
  """--target_accuracy, or the automatic target from the runs so far (the first seed's)."""
  if FLAGS.target_accuracy:
    return FLAGS.target_accuracy
  rule = target_rule()
  return rule.auto(max((rule.final(r["curve"]) for r in runs), key=rule.better))


def tune_config(study: Study, memo: Memo, runs: list[dict]) -> Tuned:
  """The tuner's best on the time model (--tuned_objective): by predicted time to accuracy with the
  staleness model fitted to ``runs`` (the first seed's, at the target they give; images/s when they give no
  fit), by images/s, or measured: the pilot runs' fastest to the target. With it, the same configuration with
  --outer, and the tuner's fastest by images/s."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.staleness import fit_staleness_model
  from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune
  target, fit = provisional_target(runs), None
  if FLAGS.tuned_objective != "throughput":
    done = [(r["mean_staleness"], target_rule().images_to(r["curve"], target, FLAGS.batch_size)) for r in runs
            if r["system"] == HETPIPE]
    try:
      fit = fit_staleness_model([(s, i) for s, i in done if i], target)
    except ConfigError as e:
      common.progress("ranking by images/s: %s", e)
  space = SearchSpace(ds=tuple(study.ds), max_stages=study.model.num_units)  # the trained model is cut over them
  options = TuneOptions(staleness_model=fit, front=0 if FLAGS.tuned_objective == "throughput" else 6,
                        setting=RunSetting(CostContext(optimizer_slots=study.slots)),
                        progress=lambda line: common.progress("tuner: %s", line))
  out = tune(study.cluster, study.clock_profiles, FLAGS.batch_size, space, options)
  best, pilots = out.best, []
  objective = "time_to_accuracy" if fit else "throughput"
  if FLAGS.tuned_objective == "measured":  # (an estimate without a staleness cost says nothing of the front)
    best, pilots = measured_best(study, memo, out.results, fit if fit and fit.beta > 0 else None, target)
    objective = "measured"
  doc = {"objective": objective, "label": best.candidate.label, "images_per_sec": best.images_per_sec,
         "mean_staleness": best.staleness, "fit": None if fit is None else dataclasses.asdict(fit),
         "provisional_target": target,
         "predicted_time_to_target_s": None if fit is None else fit.seconds(best.images_per_sec, best.staleness)}
  common.progress("tuned (%s): %s", doc["objective"], best.candidate.label)
  c = best.candidate
  specs = [candidate_spec(f"HetPipe tuned ({c.grouping}, D={c.d})", "HetPipe tuned", c)]
  if FLAGS.outer:
    outer = outer_spec(len(c.plans))
    specs.append(candidate_spec(f"HetPipe tuned ({c.grouping}, D={c.d}) + {outer}", "HetPipe tuned + outer", c,
                                {"ps_optimizer": outer}))
  fastest = max(out.results, key=lambda r: r.images_per_sec)
  doc["fastest"] = {"label": fastest.candidate.label, "images_per_sec": fastest.images_per_sec,
                    "mean_staleness": fastest.staleness}
  if fastest.candidate.label != c.label:
    f = fastest.candidate
    specs.append(candidate_spec(f"HetPipe tuned for images/s ({f.grouping}, D={f.d})", "HetPipe tuned for images/s",
                                f))
  return Tuned(specs, doc, pilots)


def measured_best(study: Study, memo: Memo, results: Sequence, fit, target: float) -> tuple[Any, list[dict]]:
  """Trains :func:`pilot_choices` of the tuner's results on --pilot_seed: the one that reached ``target``
  first (on the emulated clock; none: the one whose smoothed accuracy ended best), and the pilot runs' entries."""
  chosen, front = pilot_choices(results, fit, FLAGS.pilots)
  rule = target_rule()
  common.progress("measured choice: %d pilot runs on seed %d, of %d configurations on the front", len(chosen),
                  FLAGS.pilot_seed, len(front))
  timed, pilots, runs = [], [], []
  for i, r in enumerate(chosen):
    run = train(study, memo, candidate_spec(f"pilot {i + 1}: {r.candidate.label}", "", r.candidate),
                FLAGS.pilot_seed, memo.lrs[HETPIPE])
    runs.append(run["curve"])
    when = rule.time_to(run["curve"], target)
    pilots.append({"label": r.candidate.label, "images_per_sec": r.images_per_sec,
                   "mean_staleness_sim": r.staleness, "mean_staleness": run["mean_staleness"],
                   "predicted_time_to_target_s": None if fit is None else fit.seconds(r.images_per_sec,
                                                                                      r.staleness),
                   "time_to_target_s": when,
                   "images_to_target": rule.images_to(run["curve"], target, FLAGS.batch_size),
                   "final_test_accuracy": points(run["curve"])[-1].test_accuracy, "seed": FLAGS.pilot_seed})
    common.progress("pilot %d/%d: %s: time to target %s", i + 1, len(chosen), r.candidate.label,
                    "not reached" if when is None else f"{when:.4g} s")
    if when is not None:
      timed.append((when, -r.images_per_sec, i, r))
  if not timed:  # none reached the target: the one that came closest
    common.progress("no pilot run reached the provisional target %.4g: the tuned configuration is the pilot whose "
                    "smoothed accuracy ended best", target)
    return chosen[max(range(len(chosen)), key=lambda i: (rule.better(rule.final(runs[i])), -i))], pilots
  return min(timed)[3], pilots


def ssp_run(study: Study, memo: Memo, seed: int) -> dict:
  """An SSP parameter server without pipelining (a worker per GPU that holds the model, Nm = 1, D = --ssp_d):
  the entry of the runs it makes."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.plan.allocation import horovod_gpus
  gpus = [g for g in horovod_gpus(study.cluster, study.clock_profiles, CostContext(optimizer_slots=study.slots))
          if g.type.name != FLAGS.whimpy]
  if not gpus:
    raise ConfigError("no GPU of the cluster holds the whole model for the SSP baseline; drop --ssp")
  name = f"SSP PS ({len(gpus)} GPUs) D={FLAGS.ssp_d}"
  spec = RunSpec(name, {"policy": [[g.index] for g in gpus], "nm": 1, "d": FLAGS.ssp_d}, {}, "SSP")
  run = train(study, memo, spec, seed, memo.lrs[HETPIPE])
  return {**run, "system": "ssp"}


def target_of(runs: list[dict]) -> float:
  """The automatic target of ``runs`` (:meth:`~hetpipe_jax.studies.convergence_target.Target.of_runs`)."""
  return target_rule().of_runs(runs)


def with_target(run: dict, target: float) -> dict:
  """``run`` with its time and images to ``target``, its final test accuracy (raw and smoothed) and its final
  test loss and perplexity."""
  rule, last = target_rule(), points(run["curve"])[-1]
  return {**run, "time_to_target_s": rule.time_to(run["curve"], target),
          "images_to_target": rule.images_to(run["curve"], target, FLAGS.batch_size),
          "final_test_accuracy": last.test_accuracy, "final_smoothed_accuracy": rule.final(run["curve"]),
          "final_test_loss": last.test_loss, "final_test_perplexity": perplexity(last.test_loss)}


def perplexity(loss: float) -> float:
  """exp of a mean cross-entropy per label (nats): a language model's perplexity."""
  return math.exp(loss)


def with_perplexity(run: dict) -> dict:
  """A language model's ``run`` with its ``perplexity_curve``: [time s, test perplexity] at every evaluation."""
  return {**run, "perplexity_curve": [[p.time, perplexity(p.test_loss)] for p in points(run["curve"])]}


def study_doc(study: Study, seeds: list[int], runs: list[dict], tuned: Tuned | None, target: float,
              memo: Memo) -> dict:
  """convergence.json: the setting, the table, every configuration's summary over seeds, the learning rates and
  their pilots, the tuned configurations, the fitted staleness model and its validation, every run."""
  names = list(dict.fromkeys(run["name"] for run in runs))
  summary = {name: summarise([r for r in runs if r["name"] == name]) for name in names}
  tuned_doc = {} if tuned is None else {**tuned.doc, **({"pilots": tuned.pilots} if tuned.pilots else {})}
  rule = target_rule().rule()
  return {"target_accuracy": target, "target_metric": FLAGS.target_metric,
          "target_rule": "given" if FLAGS.target_accuracy else rule, "smooth": FLAGS.smooth,
          "time_axis": study.time_axis, "time_model": FLAGS.time_model, "model": study.model.name,
          "optimizer": FLAGS.optimizer,
          "dataset": study.dataset.name, "cluster": study.cluster.name, "epochs": FLAGS.epochs, "whimpy": FLAGS.whimpy,
          "seeds": seeds, "ideal_images_per_sec": study.ideal, "unit": study.unit, "per_example": study.per_example,
          "table": table(summary), "summary": summary,
          "learning_rates": memo.lrs, "lr_rule": lr_rule(), "lr_pilots": memo.pilots,
          "not_run": study.not_run, "tuned": tuned_doc, **unigram_baseline(study),
          **validate_staleness_model(runs, target), "runs": runs}


def unigram_baseline(study: Study) -> dict:
  """A language model's context: the test loss and perplexity of the training set's token frequencies."""
  from hetpipe_jax.evaluate import unigram_loss
  if not study.language:
    return {}
  loss = unigram_loss(study.dataset)
  return {"unigram_test_loss": loss, "unigram_test_perplexity": perplexity(loss)}


def lr_rule() -> str:
  scaled = "linearly" if FLAGS.lr_scaling == "linear" else "with the square root"
  metric = "test loss" if target_rule().loss else "accuracy"
  return (f"{FLAGS.base_lr:g} per 32-example update, scaled {scaled} with the examples of one update, times each "
          f"of {','.join(FLAGS.lr_grid)}; the best final smoothed {metric} after {FLAGS.lr_epochs} epochs on seed "
          f"{FLAGS.pilot_seed}, the grid extended past an edge that is best up to {LR_EXTENSIONS} times")


def table(summary: dict[str, dict]) -> list[dict]:
  """One row per configuration: images/s, efficiency and their ratio to the best peer, time to target (mean,
  min, max over seeds) and the best peer's mean time over it."""
  peers = [s for s in summary.values() if is_peer(s["system"])]
  best_ips = max((s["images_per_sec"] for s in peers), default=None)
  times = [s["mean_time_to_target_s"] for s in peers if s["mean_time_to_target_s"] is not None]
  best_time = min(times, default=None)
  rows = []
  for name, s in summary.items():
    t = s["mean_time_to_target_s"]
    rows.append({"name": name, "row": s["row"], "system": s["system"], "gpus": s["gpus"],
                 "images_per_sec": s["images_per_sec"], "efficiency": s["efficiency"],
                 "images_per_sec_vs_best_peer": s["images_per_sec"] / best_ips if best_ips else None,
                 "mean_time_to_target_s": t, "min_time_to_target_s": s["min_time_to_target_s"],
                 "max_time_to_target_s": s["max_time_to_target_s"], "missed": s["missed"], "seeds": len(s["seeds"]),
                 "speedup_vs_best_peer": best_time / t if best_time and t else None,
                 "mean_final_smoothed_accuracy": s["mean_final_smoothed_accuracy"], "lr": s["lr"]})
  return rows


def write_outputs(study: Study, doc: dict) -> dict[str, str]:
  """convergence.json, the CSV of every run's curve and the plot: kind -> path."""
  paths = {name: common.output_path(FLAGS.out_dir, f"convergence.{ext}")
           for name, ext in (("json", "json"), ("csv", "csv"), ("plot", "png"))}
  runs, epoch = doc["runs"], study.epoch
  common.write_json(paths["json"], doc)
  common.write_csv(paths["csv"], ["name", "system", "seed", "d", "time_s", "minibatches", "epochs", "test_accuracy",
                                  "train_loss", "test_loss", "test_perplexity"],
                   ([run["name"], run["system"], run["seed"], run["d"], t, mbs, mbs / epoch, acc, loss, test_loss,
                     perplexity(test_loss)]
                    for run in runs for t, mbs, acc, loss, test_loss in run["curve"]))
  plot(runs, epoch, doc["target_accuracy"], paths["plot"], f"{study.model.name} on {study.dataset.name}; time: "
       f"{study.time_axis}; seeds {doc['seeds']}", doc.get("unigram_test_perplexity"))
  return paths


def report(doc: dict, tuned: Tuned | None) -> None:
  """Prints the learning rates, the one table, the staleness, the fit, the tuned configuration's prediction
  and the time axis."""
  rates = ", ".join(f"{k} {v:.4g}" for k, v in doc["learning_rates"].items())
  print(f"learning rates ({doc['lr_rule']}): {rates}")
  for system, reason in doc["not_run"].items():
    print(f"{system}: not run ({reason})")
  print_table(doc)
  print_perplexity(doc)
  print_staleness(doc)
  print_fit(doc)
  print_tuned(doc, tuned)
  print(f"time axis: {doc['time_axis']} (emulated seconds, not wall time); images/s: the sim executor's, or the "
        "peer's simulated round")


def print_table(doc: dict) -> None:
  """The one table of the study (see :func:`table`)."""
  target = doc["target_accuracy"]
  what = "test loss" if doc["target_metric"] == "loss" else "test accuracy"
  print(f"target: {target:.4f} {what} ({doc['target_rule']}), smoothed over {doc['smooth']} evaluations; "
        f"{doc['epochs']} epochs; seeds {doc['seeds']}")
  unit, per = doc["unit"], doc["per_example"]
  print(f"{'configuration':58} {'GPUs':>4} {unit + '/s':>9} {'eff.':>5} {'vs peer':>7} "
        f"{'time to target: mean (min..max) s':>34} {'vs peer':>7} {'final':>6}")
  for r in doc["table"]:
    ratio = f"{r['images_per_sec_vs_best_peer']:.2f}x" if r["images_per_sec_vs_best_peer"] else "-"
    t = r["mean_time_to_target_s"]
    when = (f"{t:.4g} ({r['min_time_to_target_s']:.4g}..{r['max_time_to_target_s']:.4g})" if t is not None
            else f"missed by {r['missed']} of {r['seeds']}")
    speed = f"{r['speedup_vs_best_peer']:.2f}x" if r["speedup_vs_best_peer"] else "-"
    print(f"{r['name'][:58]:58} {r['gpus']:>4} {r['images_per_sec'] * per:9.1f} {r['efficiency']:5.2f} {ratio:>7} "
          f"{when:>34} {speed:>7} {r['mean_final_smoothed_accuracy']:6.4f}")
  print(f"vs peer: {unit}/s over the best peer's; the best peer's mean time to target over this one's (> 1: faster)")


def print_perplexity(doc: dict) -> None:
  """A language model's final test perplexity per configuration, beside the unigram baseline's."""
  if "unigram_test_perplexity" not in doc:
    return
  print(f"test perplexity (exp of the test loss per token; the training set's unigram frequencies: "
        f"{doc['unigram_test_perplexity']:.4g}, loss {doc['unigram_test_loss']:.4f}):")
  for name, s in doc["summary"].items():
    runs = [r for r in doc["runs"] if r["name"] == name]
    print(f"  {name}: final {s['mean_final_test_perplexity']:.4g} (mean over {len(runs)} seeds; loss "
          f"{sum(r['final_test_loss'] for r in runs) / len(runs):.4f}) at {runs[0]['curve'][-1][0]:.4g} s")


def print_staleness(doc: dict) -> None:
  """Every HetPipe configuration's mean and largest staleness, and its time scale to the sim executor."""
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
  print(f"staleness-aware estimate: images to {doc['target_accuracy']:.4g} = {fit['images0']:.4g} x (1 + "
        f"{fit['beta']:.4g} x mean staleness); leave-one-out error on time to target: {error}")


def print_tuned(doc: dict, tuned: Tuned | None) -> None:
  """The pilot runs, and the tuned configuration's predicted time to target against the measured one."""
  info = doc["tuned"]
  for p in info.get("pilots", []):
    when = "not reached" if p["time_to_target_s"] is None else f"{p['time_to_target_s']:.4g} s"
    print(f"pilot (seed {p['seed']}): {p['label']}: {p['images_per_sec']:.1f} images/s, mean staleness "
          f"{p['mean_staleness']:.2f}, time to the provisional target {when}")
  if tuned is None or info.get("predicted_time_to_target_s") is None:
    return
  measured = doc["summary"][tuned.specs[0].name]["mean_time_to_target_s"]
  how = "the pilot runs" if info["objective"] == "measured" else "predicted time to the provisional target"
  print(f"tuned by {how} ({info['label']}): the estimate predicted {info['predicted_time_to_target_s']:.4g} s to "
        f"{info['provisional_target']:.4g} before it ran; measured to {doc['target_accuracy']:.4g}: " +
        (f"{measured:.4g} s (mean over seeds)" if measured is not None else "not reached by every seed"))


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
  """One configuration over seeds: its row, system, images/s and efficiency, the mean and range of its time
  to target, its final accuracy (raw and smoothed)."""
  times = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
  reached = len(times) == len(runs)
  first = runs[0]
  return {"row": first["row"], "system": first["system"], "gpus": first["gpus"], "lr": first["lr"],
          "images_per_sec": first["images_per_sec"], "efficiency": first["efficiency"],
          "seeds": [r["seed"] for r in runs], "missed": len(runs) - len(times),
          "mean_time_to_target_s": sum(times) / len(times) if reached else None,
          "min_time_to_target_s": min(times) if times else None, "max_time_to_target_s": max(times) if times else None,
          "mean_final_test_accuracy": sum(r["final_test_accuracy"] for r in runs) / len(runs),
          "mean_final_test_perplexity": sum(r["final_test_perplexity"] for r in runs) / len(runs),
          "mean_final_smoothed_accuracy": sum(r["final_smoothed_accuracy"] for r in runs) / len(runs)}


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


def plot(runs: list[dict], epoch: float, target: float, path: str, title: str,
         unigram_perplexity: float | None = None) -> None:
  """Test accuracy against emulated time and against epochs: per configuration the mean over seeds, and
  the band between the lowest and highest seed (every seed is evaluated at the same points); peers dashed.
  A language model (``unigram_perplexity`` given) adds its test perplexity against emulated time, and the
  unigram baseline's."""
  import numpy as np
  plt = common.pyplot()
  language = unigram_perplexity is not None
  fig, axes = plt.subplots(1, 3 if language else 2, figsize=(19 if language else 13, 4.6))
  ax_t, ax_e = axes[0], axes[1]
  for name in dict.fromkeys(run["name"] for run in runs):
    curves = [r["curve"] for r in runs if r["name"] == name]
    n = min(len(c) for c in curves)
    acc = np.array([target_rule().values(c[:n]) for c in curves])
    ppl = np.exp(np.array([[p.test_loss for p in points(c[:n])] for c in curves]))
    style = "--" if is_peer(runs[[r["name"] for r in runs].index(name)]["system"]) else "-"
    times = [p[0] for p in curves[0][:n]]
    panels = [(ax_t, times, acc), (ax_e, [p[1] / epoch for p in curves[0][:n]], acc)]
    panels += [(axes[2], times, ppl)] if language else []
    for ax, x, y in panels:
      line, = ax.plot(x, y.mean(axis=0), style, label=f"{name[:50]} ({len(curves)} seeds)")
      if len(curves) > 1:
        ax.fill_between(x, y.min(axis=0), y.max(axis=0), color=line.get_color(), alpha=0.15, lw=0)
  if language:
    axes[2].axhline(unigram_perplexity, color="grey", lw=0.8, ls=":", label="unigram baseline")
    axes[2].set(xlabel="emulated time (s)", ylabel="test perplexity (mean; band: seeds' range)", xscale="log")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=6, loc="upper right")
  for ax in (ax_t, ax_e):
    ax.axhline(target, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
  ax_e.legend(fontsize=6, loc="lower right")
  what = target_rule().what
  ax_t.set(xlabel="emulated time (s)", ylabel=f"{what} (mean; band: seeds' range)", xscale="log")
  ax_e.set(xlabel="epochs", ylabel=f"{what} (mean; band: seeds' range)")
  fig.suptitle(title, fontsize=9)
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
