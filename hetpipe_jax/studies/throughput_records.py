"""The throughput study's configuration, records and per-model state, which its other modules share and which
import none of them: :class:`ThroughputConfig` in, :class:`ThroughputResult` (one :class:`ModelTable` per model)
out, and :class:`ModelStudy`, one model while its table (:mod:`hetpipe_jax.studies.throughput_table`) and
sub-studies (:mod:`hetpipe_jax.studies.throughput_substudies`) are built (:mod:`hetpipe_jax.studies.throughput`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import Cluster
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.plan.costmodel import ideal_images_per_sec
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.plan.partition import NM_POLICIES
from hetpipe_jax.recompute import CHOICES
from hetpipe_jax.sim import SimJob, SimOptions
from hetpipe_jax.sim.replan import KEEP, Replanning
from hetpipe_jax.studies.throughput_goodput import NOT_TRAINED
from hetpipe_jax.systems import WSP, systems
from hetpipe_jax.systems.hetpipe import simulated_rate

SUB_STUDIES = ("nm", "closed_form", "whimpy")
PEERS = ("horovod", "hetero_dp", "sync_pipeline", "local_sgd")
OBJECTIVES = ("time_to_accuracy", "throughput")
Progress = Callable[[str], None]


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
    knobs: their knobs (``microbatches`` 0: the cluster's GPUs, as the convergence study sets them); ``tp`` is also
      the HetPipe rows' tensor-parallel degree (:mod:`hetpipe_jax.plan.tensor_groups`; "auto": the planner's
      fastest), and a row at another degree than 1 is named with it (``HetPipe ED D=0 tp=2``).
    nms: the Nm rules of the HetPipe policy rows (:data:`~hetpipe_jax.plan.partition.NM_POLICIES`): every
      policy's rows at each (``max_fit``'s named ``HetPipe NP D=0``, another's ``HetPipe NP speed D=0``).
    recompute: activation recomputation of every system (:mod:`hetpipe_jax.recompute`; auto: HetPipe's planner
      per stage, a peer the fastest mode it can run).
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
  nms: tuple[str, ...] = ("max_fit",)
  recompute: str = "none"

  def __post_init__(self):
    if not self.ds or any(d < 0 for d in self.ds):
      raise ConfigError(f"--ds={','.join(map(str, self.ds))}; give one or more clock distance bounds D >= 0")
    if self.batch_size < 1 or self.gpt_batch_size < 0:
      raise ConfigError(f"--batch_size={self.batch_size}, --gpt_batch_size={self.gpt_batch_size}; give a batch size "
                        ">= 1 (--gpt_batch_size=0: --batch_size)")
    if set(self.sub_studies) - set(SUB_STUDIES):
      raise ConfigError(f"--sub_studies={','.join(self.sub_studies)}; choose among {', '.join(SUB_STUDIES)}")
    if not self.nms or set(self.nms) - set(NM_POLICIES) or len(set(self.nms)) < len(self.nms):
      raise ConfigError(f"--nms={','.join(self.nms)}; give one or more of {', '.join(NM_POLICIES)}, each once")
    if self.tuned_objective not in OBJECTIVES:
      raise ConfigError(f"--tuned_objective={self.tuned_objective}; choose one of {', '.join(OBJECTIVES)}")
    if self.recompute not in CHOICES:
      raise ConfigError(f"--recompute={self.recompute}; choose one of {', '.join(CHOICES)}")

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
    mfu: model flops utilisation: the model's forward and backward flops per example (a recomputed forward not
      counted) x examples/s, over the peak flop/s (fp32) of every GPU of the cluster.
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
  mfu: float | None
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
  breakdowns: dict[str, dict[str, Any]]  # system -> {"row": its fastest row, "shares": {category: share}}

  @property
  def best_peer(self) -> TableEntry | None:
    return best_peer(self.table)

  def to_json(self) -> dict[str, Any]:
    return {"unit": self.unit, "per_example": self.per_example, "batch_size": self.batch_size,
            "ideal_images_per_sec": self.ideal_images_per_sec, "best_peer": (self.best_peer or EMPTY).row,
            "convergence": [d["path"] for d in self.convergence], "table": [e._asdict() for e in self.table],
            "headline": self.headline._asdict(), "breakdowns": self.breakdowns}


class _Empty(NamedTuple):
  row: None = None


EMPTY = _Empty()


class ThroughputResult(NamedTuple):
  """The study: every model's table, and the sub-studies' rows of every model."""

  cluster: str
  tuned_objective: str
  convergence: list[str]  # the convergence files read
  models: list[ModelTable]
  recompute: str = "none"

  @property
  def rows(self) -> list[SubStudyRow]:
    return [r for m in self.models for r in m.rows]

  def to_json(self) -> dict[str, Any]:
    """``throughput.json``."""
    return {"cluster": self.cluster, "tuned_objective": self.tuned_objective, "recompute": self.recompute,
            "convergence": self.convergence, "models": {m.model: m.to_json() for m in self.models},
            "rows": [r._asdict() for r in self.rows]}


def is_peer(entry: TableEntry) -> bool:
  """Whether a table entry is a peer's: a registered system that is not a WSP one (HetPipe)."""
  system = systems().get(entry.system)
  return system is not None and system.kind != WSP


def best_peer(table: Sequence[TableEntry]) -> TableEntry | None:
  """The peer entry with the most images/s (None: no peer ran)."""
  return max((e for e in table if is_peer(e) and e.images_per_sec), key=lambda e: e.images_per_sec or 0.0,
             default=None)


def describe(e: TableEntry | None) -> str:
  """A table entry in words: its row, throughput and ratio to the best peer (a headline's)."""
  if e is None:
    return "none (no row ran)"
  ratio = "" if e.ratio_to_best_peer is None else f", {e.ratio_to_best_peer:.2f}x the best peer"
  return f"{e.row}, {e.throughput:.1f} {e.unit}/s{ratio}"


def time_model_of(doc: dict[str, Any]) -> str | None:
  """The model of a convergence file's time axis ("cost model of vgg19 (batch 32) on paper_testbed")."""
  found = re.search(r"cost model of (\S+)", doc.get("time_axis", ""))
  return found[1] if found else None


def matches(doc: dict[str, Any], model: str, cluster_name: str) -> bool:
  """Whether a convergence file's time model is ``model``'s and its cluster ``cluster_name``."""
  return time_model_of(doc) == model and doc.get("cluster") == cluster_name


class ModelStudy:
  """One model while its table is built: its profiles and batch, the entries and rows so far."""

  def __init__(self, config: ThroughputConfig, model: str, profiles: tuple[BatchProfiles, int, str],
               convergence: list[dict[str, Any]], say: Progress):
    self.config, self.model_name, self.cluster, self.say = config, model, config.cluster, say
    self.batch = config.batch_of(model)
    self.costs = CostContext(optimizer_slots=optimizer_slots(config.optimizer), recompute=config.recompute)
    self.batch_profiles, self.per_example, self.unit = profiles
    self.profiles = list(self.batch_profiles.at(self.batch))
    self.convergence = [doc for doc in convergence if matches(doc, model, self.cluster.name)]
    self.sources = [d["path"] for d in convergence]  # every convergence file read, matching or not
    self.rows: list[SubStudyRow] = []
    self.table: list[TableEntry] = []
    self.notes: list[str] = []  # printed under the table
    self.trained_as: dict[str, str] = {}  # row -> the row a convergence study trains its configuration under
    self.ran: dict[str, Any] = {}  # row -> its SimJob (HetPipe) or timeline (a peer): the breakdowns' input

  def ideal(self, gpus=None, cluster: Cluster | None = None) -> float:
    return ideal_images_per_sec(cluster or self.cluster, self.profiles, self.batch, gpus)

  def peak_ips(self) -> float:
    """Examples/s at the cluster's peak flop/s (fp32): the denominator of a row's MFU."""
    flops = sum(u.fwd_flops + u.bwd_flops for u in self.profiles) / self.batch
    return sum(g.type.peak_flops("fp32") for g in self.cluster.gpus) / flops

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
                                 None if ips is None else ips / ideal, None if ips is None else ips / self.peak_ips(),
                                 None, NOT_TRAINED, None, reason, signature))
    if ips is None:
      self.say(f"{self.model_name} {row} cannot run: {reason}")
    else:
      self.say(f"{self.model_name} {row}: {ips * self.per_example:.1f} {self.unit}/s")

  def simulated_images_per_sec(self, plans, d: int = 0, placement: str = "default",
                               cluster: Cluster | None = None, row: str | None = None) -> float:
    """Examples/s of ``plans`` on the ``sim`` executor, its trace checked by the WSP checker
    (:func:`hetpipe_jax.systems.hetpipe.simulated_rate`; under noise, adapting as the knobs say); the job kept as
    ``row``'s run when a row is named."""
    job = SimJob(cluster or self.cluster, self.profiles, Layout(tuple(p.layout for p in plans)), d, self.config.waves,
                 placement, options=SimOptions(overlap_transfers=self.config.overlap_transfers,
                                               noise=self.config.knobs.noise))
    if row is not None:
      self.ran[row] = job
    adapting = self.config.knobs.adapting  # (HetPipe's re-planning, each virtual worker keeping its waves)
    return simulated_rate(job, self.batch, "simulated run", (self.costs, Replanning(nm_rule=KEEP)) if adapting
                          else None)[0]

