"""What every run of the convergence study shares (:class:`Study`, built once by :func:`make_study`): the cluster,
the trained model and its data, the time axis's cost model, the peers simulated, and the HetPipe configurations
of the policies (:class:`Spec`: a :class:`~hetpipe_jax.systems.hetpipe.HetPipeSetting` with its row)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.profile import UnitProfile, profile_units
from hetpipe_jax.data import Dataset, load_dataset
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE, full_size_input, full_size_model, get_model
from hetpipe_jax.models.base import LayeredModel
from hetpipe_jax.optim import BY_ROUND, optimizer_slots, parse_ps_optimizer
from hetpipe_jax.plan.allocation import parse_policy, plan_cluster
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.studies.convergence_config import ConvergenceConfig
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.systems import HetPipe, SystemSpec, simulate_systems
from hetpipe_jax.systems.hetpipe import HetPipeSetting

HETPIPE, HETPIPE_OUTER = HetPipe.name, "hetpipe_outer"  # HetPipe's learning-rate system; the prefix of an outer rule's
Progress = Callable[[str], None]


def outer_system(rule: str) -> str:
  """The learning-rate system of HetPipe with the outer ``rule`` (a ``--ps_optimizer`` spec): ``hetpipe_outer:NAME``."""
  return f"{HETPIPE_OUTER}:{parse_ps_optimizer(rule).name}"


class Spec(NamedTuple):
  """A HetPipe configuration of the study: its name, its setting, its row in the table (the key the throughput
  study matches) and its learning-rate system (:data:`HETPIPE`, or :func:`outer_system` with an outer rule)."""

  name: str
  setting: HetPipeSetting
  row: str = ""
  lr_system: str = HETPIPE


@dataclasses.dataclass(frozen=True)
class Study:
  """What every run of the study shares (:func:`make_study`).

  Attributes:
    config: the study's settings.
    cluster / model / dataset: the cluster, the trained model, its data.
    clock_profiles: the time axis's cost model (``config.time_model``'s, or the trained model's) at the batch size;
      profiles: the same at any batch size (what the peers are simulated with).
    time_axis: the time axis in words.
    base: every HetPipe run's config before its own fields.
    policies: the policies the planner can lay out (parsed); not_run: row -> why it cannot run (a peer, a policy).
    sim_model / sim_data: what the ``sim`` executor runs for a time scale.
    peers: one per ``config.systems``; knobs: their knobs.
    ideal: the ideal heterogeneous aggregate of the cluster on the time model.
    per_example / unit: what one example counts as in throughput (a GPT time model's tokens), ``tokens`` or
      ``images``.
    horizon: the factor (>= 1) on the config's ``epochs`` and ``lr_epochs`` that gives every system
      ``config.min_updates`` updates (:func:`horizon`; :attr:`epochs` and :attr:`lr_epochs` are the scaled ones).
    update_examples: learning-rate system or peer -> the examples behind one of its optimizer updates.
  """

  config: ConvergenceConfig
  model: LayeredModel
  dataset: Dataset
  clock_profiles: list[UnitProfile]
  profiles: BatchProfiles
  time_axis: str
  base: RunConfig
  policies: list[str | list[list[int]]]
  sim_model: LayeredModel
  sim_data: Any
  peers: list[SystemSpec]
  knobs: PeerKnobs
  ideal: float
  per_example: int
  unit: str
  not_run: dict[str, str]
  horizon: float = 1.0
  update_examples: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def cluster(self) -> Cluster:
    return self.config.cluster

  @property
  def target(self) -> Target:
    """What the target is on and how it is smoothed."""
    return Target(self.config.target_metric, self.config.smooth)

  @property
  def language(self) -> bool:
    """Whether the trained model is a language model (labels: the next tokens), whose perplexity is reported."""
    return self.dataset.y_train.ndim == 2

  @property
  def epoch(self) -> float:
    """Minibatches per epoch."""
    return len(self.dataset.x_train) / self.config.batch_size

  @property
  def epochs(self) -> float:
    """Every run's length, in epochs (``config.epochs`` x :attr:`horizon`)."""
    return self.config.epochs * self.horizon

  @property
  def lr_epochs(self) -> float:
    """Every learning-rate pilot's length, in epochs (``config.lr_epochs`` x :attr:`horizon`)."""
    return self.config.lr_epochs * self.horizon

  @property
  def total(self) -> int:
    """Minibatches every run sees."""
    return int(self.epochs * len(self.dataset.x_train) / self.config.batch_size)

  @property
  def costs(self) -> CostContext:
    return study_costs(self.config)

  def policy_specs(self) -> list[Spec]:
    """HetPipe at every policy and every D of the config (under ``config.ps_optimizer``, the row's name says which
    when not ``add``)."""
    specs, rule = [], self.config.ps_optimizer
    for policy in self.policies:
      label = policy if isinstance(policy, str) else "/".join(",".join(map(str, g)) for g in policy)
      tp = self.config.knobs.tp
      for d in self.config.ds:
        name = f"HetPipe {label} D={d}" + ("" if tp == 1 else f" tp={tp}")  # (the throughput study's row)
        setting = HetPipeSetting(policy, self.config.nm, d, tp=None if tp == 1 else tp)
        if rule != "add":
          setting = setting._replace(ps_optimizer=self.outer_spec(len(self.plan_nms(setting)), rule))
          name += f" + {parse_ps_optimizer(rule).name}"
        specs.append(Spec(name, setting, name))
    return specs

  def plan_nms(self, setting: HetPipeSetting) -> list[int]:
    """Nm of every virtual worker of ``setting`` (planned for a policy)."""
    if setting.cuts is not None:
      return list(setting.nm)
    return [p.nm for p in plan_cluster(self.cluster, self.clock_profiles, setting.policy, "default", self.config.nm,
                                       None, self.costs, setting.tp or 1).vws]

  def outer_spec(self, num_vws: int, rule: str, lr: float | None = None) -> str:
    """The outer ``rule`` for a configuration of ``num_vws`` virtual workers, at ``lr`` (None: the rule's own): its
    learning rate is DiLoCo's, one step on the mean of the workers' changes per round; every push of WSP takes its
    own step, so the server's rate per push is that over ``num_vws`` (a rule of a round of N pushes, ``avg``,
    ``delayed_nesterov`` or ``heloco``, weighs the pushes itself)."""
    parsed = parse_ps_optimizer(rule)
    parsed = parsed if lr is None else parsed._replace(lr=lr)  # (``add`` has no rate: its spec stays ``add``)
    if parsed.name == "add" or parsed.name in BY_ROUND:
      return str(parsed)
    return str(parsed._replace(lr=parsed.lr / num_vws))


def time_profiles(config: ConvergenceConfig, model: LayeredModel, dataset: Dataset) -> BatchProfiles:
  """The time axis's cost model: the full-size time model's, or the trained model's own."""
  b, time_model = config.batch_size, config.time_model_name
  if time_model:
    return BatchProfiles.full_size(time_model, b)
  sample = lambda n: jax.ShapeDtypeStruct((n,) + dataset.x_train.shape[1:], dataset.x_train.dtype)
  return BatchProfiles(tuple(profile_units(model, sample(b))), tuple(profile_units(model, sample(2 * b))), b, 2 * b)


def study_costs(config: ConvergenceConfig) -> CostContext:
  """What every system's memory and time are charged: the optimizer's slots and the recomputation (HetPipe's
  staleness control charges its own memory: its runs' base config and :meth:`HetPipe.simulate` add it)."""
  return CostContext(optimizer_slots=optimizer_slots(config.optimizer), recompute=config.recompute)


def examples_unit(time_model: str | None, dataset: Dataset) -> int:
  """Tokens per example of the time axis: a GPT time model's context, the trained language model's sequence
  when the time axis is its own, else 1 (images)."""
  if time_model:
    return full_size_input(time_model, 1).shape[1] if time_model.startswith("gpt") else 1
  return dataset.x_train.shape[1] if dataset.y_train.ndim == 2 else 1


def make_study(config: ConvergenceConfig, progress: Progress) -> Study:
  """The trained model and data, the time axis, the peers (simulated) and every HetPipe run's base config."""
  cluster, b, time_model = config.cluster, config.batch_size, config.time_model_name
  dataset = load_dataset(config.dataset).with_test_examples(config.eval_test_examples)
  model = get_model(config.model, dataset.num_classes)
  profiles = time_profiles(config, model, dataset)
  units = list(profiles.at(b))
  per_example = examples_unit(time_model, dataset)
  time_axis = (f"cost model of {time_model} (batch {b}) on {cluster.name}" if time_model
               else f"cost model of {model.name} on {cluster.name}")
  base = RunConfig.of(cluster=cluster, batch_size=b, optimizer=config.optimizer, time_model=time_model,
                      recompute=config.recompute, staleness=config.knobs.staleness, executor="virtual",
                      lr_schedule=config.lr_schedule)
  sim_model, sim_data = (full_size_model(time_model), FULL_SIZE[time_model]) if time_model else (model, dataset)
  knobs = config.knobs._replace(microbatches=config.knobs.microbatches or cluster.num_gpus)
  costs = study_costs(config)
  peers = simulate_systems(config.systems, config.peer_cluster,
                           profiles, b, costs, knobs, time_model or model.name, progress)
  policies, not_run = plannable(config, units, costs, model.num_units)
  not_run.update({p.system.name: str(p.reason) for p in peers if p.run is None})
  study = Study(config, model, dataset, units, profiles, time_axis, base, policies, sim_model, sim_data, peers, knobs,
                ideal_images_per_sec(cluster, units, b), per_example, "tokens" if per_example > 1 else "images",
                not_run)
  examples = {p.system.name: p.update_examples for p in peers if p.run is not None}
  examples[HETPIPE] = b * max(config.knobs.control.accumulate(nm) for spec in study.policy_specs()
                              for nm in study.plan_nms(spec.setting))
  scale = horizon(config, examples, len(dataset.x_train))
  if scale > 1:
    progress(f"horizon: {config.epochs:g} epochs x {scale:.4g} so that every system takes {config.min_updates} "
             f"updates (the most examples per update: {max(examples.values())})")
  return dataclasses.replace(study, horizon=scale, update_examples=examples)


def horizon(config: ConvergenceConfig, update_examples: dict[str, int], train_examples: int) -> float:
  """The factor (>= 1) on ``config.epochs`` and ``config.lr_epochs`` so that the system with the most examples per
  optimizer update (``update_examples``) takes ``config.min_updates`` updates in a run."""
  needed = config.min_updates * max(update_examples.values(), default=0) / train_examples
  return max(1.0, needed / config.epochs)


def plannable(config: ConvergenceConfig, profiles: list[UnitProfile], costs: CostContext,
              num_units: int) -> tuple[list, dict[str, str]]:
  """The policies the planner can lay out on the cluster (memory) with virtual workers of at most ``num_units``
  GPUs (the trained model is cut over them), and why each other one cannot run.

  Raises:
    ConfigError: when none can.
  """
  kept, reasons = [], {}
  for policy in [parse_policy(p) for p in config.policies]:
    try:
      plan = plan_cluster(config.cluster, profiles, policy, "default", config.nm, None, costs, config.knobs.tp)
      widest = max(len(vw.stages) for vw in plan.vws)
      if widest > num_units:
        raise ConfigError(f"its virtual workers have {widest} GPUs, and the trained model has only {num_units} "
                          "units to cut over them; train a deeper model (--model) or use other --policies")
      kept.append(policy)
    except ConfigError as e:
      reasons[f"HetPipe {policy}"] = str(e)
  if not kept:
    raise ConfigError(f"no policy of --policies={','.join(config.policies)} fits cluster {config.cluster.name!r}: "
                      f"{next(iter(reasons.values()))}")
  return kept, reasons
