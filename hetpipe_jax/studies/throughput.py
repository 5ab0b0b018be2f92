"""The throughput study on the simulated cluster as library code: HetPipe against its peers, one table per model
(:func:`run_throughput`: a :class:`ThroughputConfig` in, a :class:`ThroughputResult` out).

For each model the table holds the systems of ``config.systems`` (:mod:`hetpipe_jax.systems`: simulated on the same
network, cost model and memory model), HetPipe NP, ED and HD at every D of ``config.ds`` (the planner's partitions
and Nm, on the ``sim`` executor), and with ``config.tuned`` the tuner's rows (``HetPipe tuned``, ``HetPipe tuned
for images/s``, ``HetPipe tuned + outer``); each row's goodput mark comes from the convergence studies given
(:mod:`hetpipe_jax.studies.throughput_goodput`). The sub-studies outside the table: ``nm`` (one virtual worker as
Nm grows), ``closed_form`` (the closed-form Horovod estimate), ``whimpy`` (HetPipe without the whimpy GPUs).
``experiments.throughput`` turns its flags into a :class:`ThroughputConfig` and writes the files.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.baselines.horovod import horovod_images_per_second
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster, make_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.allocation import allocate, horovod_gpus, plan_cluster
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.partition import partition
from hetpipe_jax.sim import SimJob, SimOptions, simulate
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.studies.throughput_goodput import NOT_TRAINED, REACHES, goodput
from hetpipe_jax.systems import WSP, HetPipe, simulate_systems, systems
from hetpipe_jax.systems.hetpipe import require_wsp
from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune

SUB_STUDIES = ("nm", "closed_form", "whimpy")
PEERS = ("horovod", "hetero_dp", "sync_pipeline", "local_sgd")
HETPIPE = HetPipe.name
POLICIES = ("NP", "ED", "HD")
TUNED, TUNED_IPS, TUNED_OUTER = "HetPipe tuned", "HetPipe tuned for images/s", "HetPipe tuned + outer"
OBJECTIVES = ("time_to_accuracy", "throughput")
Progress = Callable[[str], None]
ProfilesOf = Callable[[str, int, "int | None"], tuple[BatchProfiles, int, str]]  # (model, batch, seq_len) ->


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
  """What the study runs (the defaults: the paper's setting; ``experiments.throughput``'s flags).

  Attributes:
    cluster: the cluster.
    models: the models studied.
    batch_size: minibatch size of the image models; gpt_batch_size: of a GPT model (0: ``batch_size``).
    seq_len: GPT models' tokens per sequence (None: the model's context).
    waves: simulated waves per virtual worker.
    nm_max: the largest Nm of the ``nm`` sub-study.
    ds: the clock distance bounds D of the HetPipe rows and the tuner; tune_ds: the tuner's (empty: ``ds``).
    sub_studies: those of :data:`SUB_STUDIES` that run.
    whimpy: the GPU type left out of one side of the whimpy sub-study.
    optimizer: the local optimizer, for its memory.
    overlap_transfers: the HetPipe policy rows' stage-to-stage transfers overlapped with computation.
    tuned: add the tuned rows; max_stages: most stages per virtual worker the tuner tries (0: no limit).
    tuned_objective: what ``HetPipe tuned`` optimises, ``time_to_accuracy`` (the staleness model of a matching
      convergence study; images/s without one) or ``throughput``.
    systems: the peers of the table (registered systems).
    knobs: their knobs (``microbatches`` 0: the cluster's GPUs, as the convergence study sets them).
  """

  cluster: Cluster
  models: tuple[str, ...] = ("vgg19", "resnet152")
  batch_size: int = 32
  gpt_batch_size: int = 8
  seq_len: int | None = None
  waves: int = 100
  nm_max: int = 8
  ds: tuple[int, ...] = (0, 4, 32)
  tune_ds: tuple[int, ...] = ()
  sub_studies: tuple[str, ...] = SUB_STUDIES
  whimpy: str = "RTX 2060"
  optimizer: str = "momentum"
  overlap_transfers: bool = False
  tuned: bool = True
  max_stages: int = 0
  tuned_objective: str = "time_to_accuracy"
  systems: tuple[str, ...] = PEERS
  knobs: PeerKnobs = PeerKnobs(h_by_speed=True)

  def __post_init__(self):
    if not self.ds or any(d < 0 for d in self.ds):
      raise ConfigError(f"--ds={','.join(map(str, self.ds))}; give one or more clock distance bounds D >= 0")
    if self.batch_size < 1 or self.gpt_batch_size < 0:
      raise ConfigError(f"--batch_size={self.batch_size}, --gpt_batch_size={self.gpt_batch_size}; give a batch size "
                        ">= 1 (--gpt_batch_size=0: --batch_size)")
    if set(self.sub_studies) - set(SUB_STUDIES):
      raise ConfigError(f"--sub_studies={','.join(self.sub_studies)}; choose among {', '.join(SUB_STUDIES)}")
    if self.tuned_objective not in OBJECTIVES:
      raise ConfigError(f"--tuned_objective={self.tuned_objective}; choose one of {', '.join(OBJECTIVES)}")

  def batch_of(self, model: str) -> int:
    """The model's minibatch size."""
    gpt = model.lower().startswith("gpt")
    return self.gpt_batch_size if gpt and self.gpt_batch_size else self.batch_size


class TableEntry(NamedTuple):
  """A row of a model's table (JSON: these keys in this order).

  Attributes:
    model / row / system / config: the model, the row's name, its system's name, what ran.
    objective: what a tuned row optimised (None for the others).
    gpus: the GPUs that train (None: it cannot run).
    images_per_sec: examples/s (None: it cannot run, ``reason``); throughput: in ``unit``/s.
    ideal_images_per_sec / efficiency: the ideal aggregate of the cluster, images/s over it.
    ratio_to_best_peer: images/s over the best peer's.
    goodput / time_to_target_s: the convergence study's mark and mean time to target.
    reason: why it cannot run.
    signature: what identifies its configuration among a convergence study's runs.
  """

  model: str
  row: str
  system: str
  config: str
  objective: str | None
  gpus: int | None
  images_per_sec: float | None
  throughput: float | None
  unit: str
  ideal_images_per_sec: float
  efficiency: float | None
  ratio_to_best_peer: float | None
  goodput: str
  time_to_target_s: float | None
  reason: str | None
  signature: list[Any] | None


class SubStudyRow(NamedTuple):
  """A sub-study's row (JSON: these keys in this order)."""

  model: str
  study: str
  config: str
  gpus: int
  nm: int
  d: int
  transfers: str
  images_per_sec: float
  ideal_images_per_sec: float
  efficiency: float


class Headline(NamedTuple):
  """A model's headline: the fastest row that reaches the target (without convergence data: the fastest row)."""

  row: str | None
  goodput_known: bool
  images_per_sec: float | None
  throughput: float | None
  unit: str
  ratio_to_best_peer: float | None
  fastest: str | None
  fastest_throughput: float | None
  note: str


class ModelTable(NamedTuple):
  """One model on the cluster: its table, notes, headline and sub-study rows."""

  model: str
  cluster: Cluster
  unit: str
  per_example: int
  batch_size: int
  ideal_images_per_sec: float
  table: list[TableEntry]
  notes: list[str]
  headline: Headline
  rows: list[SubStudyRow]
  convergence: list[dict[str, Any]]

  @property
  def best_peer(self) -> TableEntry | None:
    return best_peer(self.table)

  def to_json(self) -> dict[str, Any]:
    return {"unit": self.unit, "per_example": self.per_example, "batch_size": self.batch_size,
            "ideal_images_per_sec": self.ideal_images_per_sec, "best_peer": (self.best_peer or EMPTY).row,
            "convergence": [d["path"] for d in self.convergence], "table": [e._asdict() for e in self.table],
            "headline": self.headline._asdict()}


class _Empty(NamedTuple):
  row: None = None


EMPTY = _Empty()


class ThroughputResult(NamedTuple):
  """The study: every model's table, and the sub-studies' rows of every model."""

  cluster: str
  tuned_objective: str
  convergence: list[str]  # the convergence files read
  models: list[ModelTable]

  @property
  def rows(self) -> list[SubStudyRow]:
    return [r for m in self.models for r in m.rows]

  def to_json(self) -> dict[str, Any]:
    """``throughput.json``."""
    return {"cluster": self.cluster, "tuned_objective": self.tuned_objective, "convergence": self.convergence,
            "models": {m.model: m.to_json() for m in self.models}, "rows": [r._asdict() for r in self.rows]}


def is_peer(entry: TableEntry) -> bool:
  """Whether a table entry is a peer's: a registered system that is not a WSP one (HetPipe)."""
  system = systems().get(entry.system)
  return system is not None and system.kind != WSP


def best_peer(table: Sequence[TableEntry]) -> TableEntry | None:
  """The peer entry with the most images/s (None: no peer ran)."""
  return max((e for e in table if is_peer(e) and e.images_per_sec), key=lambda e: e.images_per_sec or 0.0,
             default=None)


class _Study:
  """One model while its table is built: its profiles and batch, the entries and rows so far."""

  def __init__(self, config: ThroughputConfig, model: str, profiles: tuple[BatchProfiles, int, str],
               convergence: list[dict[str, Any]], say: Progress):
    self.config, self.model_name, self.cluster, self.say = config, model, config.cluster, say
    self.batch = config.batch_of(model)
    self.costs = CostContext(optimizer_slots=optimizer_slots(config.optimizer))
    self.batch_profiles, self.per_example, self.unit = profiles
    self.profiles = list(self.batch_profiles.at(self.batch))
    self.convergence = [doc for doc in convergence if matches(doc, model, self.cluster.name)]
    self.sources = [d["path"] for d in convergence]  # every convergence file read, matching or not
    self.rows: list[SubStudyRow] = []
    self.table: list[TableEntry] = []
    self.notes: list[str] = []  # printed under the table

  def ideal(self, gpus=None, cluster: Cluster | None = None) -> float:
    return ideal_images_per_sec(cluster or self.cluster, self.profiles, self.batch, gpus)

  def row(self, study_name: str, config: str, gpus: int, nm: int, d: int, ips: float, best: float,
          transfers: str | None = None) -> None:
    """A sub-study's row."""
    transfers = transfers or ("overlap" if self.config.overlap_transfers else "serial")  # the planned rows' model
    self.rows.append(SubStudyRow(self.model_name, study_name, config, gpus, nm, d, transfers, ips, best, ips / best))

  def entry(self, row: str, system: str, config: str, gpus: int | None, ips: float | None,
            reason: str | None = None, objective: str | None = None, signature: list | None = None) -> None:
    """A row of the table: ``ips`` examples/s, or None and the ``reason`` it cannot run."""
    ideal = self.ideal()
    self.table.append(TableEntry(self.model_name, row, system, config, objective, gpus, ips,
                                 None if ips is None else ips * self.per_example, self.unit, ideal,
                                 None if ips is None else ips / ideal, None, NOT_TRAINED, None, reason, signature))
    if ips is None:
      self.say(f"{self.model_name} {row} cannot run: {reason}")
    else:
      self.say(f"{self.model_name} {row}: {ips * self.per_example:.1f} {self.unit}/s")

  def simulated_images_per_sec(self, plans, d: int = 0, placement: str = "default",
                               cluster: Cluster | None = None) -> float:
    """Examples/s of ``plans`` on the ``sim`` executor, its trace checked by the WSP checker."""
    trace = Trace()
    seconds, vws, _ = simulate(SimJob(cluster or self.cluster, self.profiles, Layout(tuple(p.layout for p in plans)),
                                      d, self.config.waves, placement,
                                      options=SimOptions(overlap_transfers=self.config.overlap_transfers)), trace)
    require_wsp(trace.events, "simulated run")
    return sum(vw.completed for vw in vws) * self.batch / seconds


# The table.


def peer_entries(s: _Study) -> None:
  """The systems of ``config.systems``, simulated with ``config.knobs`` (microbatches 0: the cluster's GPUs)."""
  knobs = s.config.knobs
  knobs = knobs._replace(microbatches=knobs.microbatches or s.cluster.num_gpus)
  for spec in simulate_systems(s.config.systems, s.cluster, s.batch_profiles, s.batch, s.costs, knobs,
                               model=s.model_name, progress=s.say):
    name = spec.system.name
    if spec.run is None:
      s.entry(name, name, "", None, None, spec.reason)
      continue
    s.entry(name, name, spec.system.config(spec.run), spec.run.gpus, spec.run.images_per_sec,
            signature=spec.system.signature(spec.run))


def hetpipe_entries(s: _Study) -> None:
  """HetPipe NP, ED, HD at every D: the planner's partitions and Nm, default placement."""
  for policy in POLICIES:
    try:
      plan = plan_cluster(s.cluster, s.profiles, policy, "default", "max_fit", None, s.costs)
    except ConfigError as e:
      for d in s.config.ds:
        s.entry(f"HetPipe {policy} D={d}", HETPIPE, "", None, None, str(e))
      continue
    config = f"{len(plan.vws)} virtual workers, Nm {[p.nm for p in plan.vws]}, default placement"
    for d in s.config.ds:
      s.entry(f"HetPipe {policy} D={d}", HETPIPE, config, s.cluster.num_gpus,
              s.simulated_images_per_sec(plan.vws, d, "default"), signature=[[p.nm for p in plan.vws], d])


def staleness_model(s: _Study) -> StalenessModel | None:
  """The staleness model of the first matching convergence file that has one (None: none)."""
  for doc in s.convergence:
    fit = doc.get("staleness_model")
    if fit:
      return StalenessModel(fit["images0"], fit["beta"], fit.get("target_accuracy"))
  return None


def tuned_entries(s: _Study) -> None:
  """HetPipe tuned, tuned for images/s, and tuned + outer (the tuned one's timing). The tuned rows are the
  configurations a matching convergence study chose and trained, when the tuner's search holds them (so their
  goodput marks are theirs); else the tuner's best by ``config.tuned_objective`` and by images/s."""
  fit = staleness_model(s) if s.config.tuned_objective == "time_to_accuracy" else None
  try:
    out = tuned_search(s, fit)
  except ConfigError as e:
    for row in (TUNED, TUNED_IPS, TUNED_OUTER):
      s.entry(row, HETPIPE, "", None, None, str(e))
    return
  fastest = max(out.results, key=lambda r: r.images_per_sec)
  best, why = out.best, ("by predicted time to accuracy (staleness model of the convergence study)" if fit else
                         "by images/s" + ("" if s.config.tuned_objective == "throughput" else
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


def tuned_search(s: _Study, fit: StalenessModel | None):
  """The tuner's search (its best by images/s with ``fit`` None, else by predicted time to accuracy)."""
  what = "images/s" if fit is None else "time to accuracy"
  space = SearchSpace(ds=tuple(s.config.tune_ds or s.config.ds), max_stages=s.config.max_stages or None)
  out = tune(s.cluster, s.profiles, s.batch, space,
             TuneOptions(waves=s.config.waves, staleness_model=fit, setting=RunSetting(s.costs), front=6,
                         progress=lambda line: s.say(f"{s.model_name} tuner ({what}): {line}")))
  s.say(f"{s.model_name} tuned by {what} ({out.best.candidate.label}): {out.best.images_per_sec:.1f} images/s")
  return out


def finish_table(s: _Study) -> None:
  """Every entry's ratio to the best peer and goodput mark."""
  peer = best_peer(s.table)
  finished = []
  for e in s.table:
    ratio = e.images_per_sec / peer.images_per_sec if e.images_per_sec is not None and peer is not None and \
        peer.images_per_sec else None
    mark, seconds = goodput(s.convergence, e.row, e.signature)
    finished.append(e._replace(ratio_to_best_peer=ratio, goodput=mark, time_to_target_s=seconds))
  s.table = finished


def time_model_of(doc: dict[str, Any]) -> str | None:
  """The model of a convergence file's time axis ("cost model of vgg19 (batch 32) on paper_testbed")."""
  found = re.search(r"cost model of (\S+)", doc.get("time_axis", ""))
  return found[1] if found else None


def matches(doc: dict[str, Any], model: str, cluster_name: str) -> bool:
  return time_model_of(doc) == model and doc.get("cluster") == cluster_name


def headline(s: _Study) -> Headline:
  """The fastest row that reaches the target (without convergence data: the fastest row), and the fastest."""
  ran = [e for e in s.table if e.images_per_sec]
  fastest = max(ran, key=lambda e: e.images_per_sec or 0.0, default=None)
  known = any(not e.goodput.startswith(NOT_TRAINED) for e in s.table)
  best = max((e for e in ran if e.goodput == REACHES), key=lambda e: e.images_per_sec or 0.0, default=None)
  where = f"{s.model_name} on {s.cluster.name}"
  if not known:
    best = fastest
    note = (f"no convergence data for {where} (read: {', '.join(s.sources) or 'none'}); "
            f"goodput unknown: the fastest row, {describe(fastest)}")
  elif best is None:
    note = f"no row of {where} reaches the target in {', '.join(d['path'] for d in s.convergence)}"
  else:
    note = (f"the fastest row that reaches the target {target(s)}: {describe(best)}")
  return Headline(None if best is None else best.row, known, None if best is None else best.images_per_sec,
                  None if best is None else best.throughput, s.unit, None if best is None else best.ratio_to_best_peer,
                  None if fastest is None else fastest.row, None if fastest is None else fastest.throughput, note)


def target(s: _Study) -> str:
  values = sorted({d["target_accuracy"] for d in s.convergence if d.get("target_accuracy") is not None})
  return "/".join(f"{v:.4g}" for v in values) or "?"


def describe(e: TableEntry | None) -> str:
  if e is None:
    return "none (no row ran)"
  ratio = "" if e.ratio_to_best_peer is None else f", {e.ratio_to_best_peer:.2f}x the best peer"
  return f"{e.row}, {e.throughput:.1f} {e.unit}/s{ratio}"


# The sub-studies.


def nm_rows(s: _Study) -> None:
  """(a) one virtual worker, Nm = 1 .. nm_max."""
  ed, hd, nodes = allocate(s.cluster, "ED")[0], allocate(s.cluster, "HD")[0], allocate(s.cluster, "NP")
  mixes = {"ED mix (1 of each type)": ed, "HD mix (fast + whimpy)": hd,
           f"one node ({nodes[0][0].type.name})": nodes[0]}
  for label, gpus in mixes.items():
    for nm in range(1, s.config.nm_max + 1):
      try:
        plan = partition(s.cluster, s.profiles, gpus, nm, s.costs)
      except ConfigError:
        break  # memory grows with Nm
      s.row("nm", label, len(gpus), nm, 0, s.simulated_images_per_sec([plan]), s.ideal(gpus))
      s.say(f"{s.model_name} {label} Nm={nm}: {s.rows[-1].images_per_sec:.1f} images/s")


def closed_form_horovod(s: _Study, study_name: str) -> None:
  """(b) the closed-form Horovod estimate on the GPUs that hold the model: its row (none when no GPU does)."""
  gpus = horovod_gpus(s.cluster, s.profiles, s.costs)
  if gpus:
    ips = horovod_images_per_second(s.cluster, s.profiles, gpus, s.batch, overlap=False)
    s.row(study_name, f"Horovod (closed form), {len(gpus)} GPUs that hold the model", len(gpus), 1, 0, ips,
          s.ideal(), "serial")


def whimpy_rows(s: _Study) -> bool:
  """(c) whimpy GPUs: HetPipe on the others, HetPipe on all (skipped when the cluster has no such GPUs or
  nothing else, or the model does not fit); whether it ran."""
  cluster, whimpy = s.cluster, s.config.whimpy
  kept = [[g.type for g in cluster.node_gpus(n)] for n in sorted({g.node for g in cluster.gpus})
          if cluster.node_gpus(n)[0].type.name != whimpy]
  if not kept or len(kept) == len({g.node for g in cluster.gpus}):
    s.say(f"whimpy sub-study skipped: {cluster.name} has no nodes of {whimpy} GPUs, or only those")
    return False
  without = make_cluster(f"{cluster.name}-no-whimpy", kept, cluster.intra_node, cluster.inter_node)
  for label, c in ((f"HetPipe ED-local, {without.num_gpus} GPUs (no {whimpy})", without),
                   (f"HetPipe ED-local, {cluster.num_gpus} GPUs", cluster)):
    try:
      plan = plan_cluster(c, s.profiles, "ED", "local", "max_fit", None, s.costs)
    except ConfigError as e:
      s.say(f"whimpy sub-study skipped, {label}: {e}")
      return False
    s.row("whimpy", label, c.num_gpus, max(p.nm for p in plan.vws), 0,
          s.simulated_images_per_sec(plan.vws, 0, "local", c), s.ideal(cluster=c))
  return True


def study_model(config: ThroughputConfig, model: str, profiles: tuple[BatchProfiles, int, str],
                convergence: list[dict[str, Any]], say: Progress) -> ModelTable:
  """One model: the table (peers, HetPipe policies, tuned rows, goodput) and the sub-studies."""
  s = _Study(config, model, profiles, convergence, say)
  peer_entries(s)
  hetpipe_entries(s)
  if config.tuned:
    tuned_entries(s)
  finish_table(s)
  if "nm" in config.sub_studies:
    nm_rows(s)
  if "closed_form" in config.sub_studies:
    closed_form_horovod(s, "closed_form")
  if "whimpy" in config.sub_studies and whimpy_rows(s):
    closed_form_horovod(s, "whimpy")
  return ModelTable(model, s.cluster, s.unit, s.per_example, s.batch, s.ideal(), s.table, s.notes, headline(s),
                    s.rows, s.convergence)


def run_throughput(config: ThroughputConfig, profiles_of: ProfilesOf, convergence: Sequence[dict[str, Any]] = (),
                   convergence_paths: Sequence[str] = (), progress: Progress | None = None) -> ThroughputResult:
  """The study (the module docstring).

  Args:
    config: what runs.
    profiles_of: ``(model, batch size, seq_len) -> (BatchProfiles, what one example counts as, its unit)``.
    convergence: the convergence studies' ``convergence.json`` documents, each with its ``path``
      (:func:`~hetpipe_jax.studies.throughput_goodput.convergence_docs`).
    convergence_paths: the files the caller meant to read (recorded).
    progress: where progress lines go.

  Raises:
    ConfigError: for a model, system or cluster the study cannot use.
  """
  say = progress or (lambda _: None)
  models = [study_model(config, model, profiles_of(model, config.batch_of(model), config.seq_len),
                        list(convergence), say) for model in config.models]
  return ThroughputResult(config.cluster.name, config.tuned_objective, list(convergence_paths), models)
