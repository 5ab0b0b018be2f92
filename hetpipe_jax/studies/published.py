"""The published measurements and how the simulator runs them: the table, the clusters, the fit and the
errors of ``experiments.validate_published`` (issue 24).

Every row of the table (``experiments/data/published.csv``) is a measurement someone published; each is
simulated on the same cost model, catalogue, links and network as every study, by the peer of
:mod:`hetpipe_jax.baselines` that the row names. :func:`fit_efficiency` calibrates each GPU type's roofline
efficiency per model family (per setup, per type, or not at all) and the intra-node links on two-GPU
all-reduce times; :func:`evaluate` simulates every row on its calibrated catalogue; :func:`summary` gives the
errors of the held-out rows.

Example::

  rows = read_table("experiments/data/published.csv")
  entries = evaluate(rows, fit_efficiency(rows, ["resnet50", "vgg16", "inception_v3"]))
  summary(entries).held_out.median_error
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.baselines.collective import allreduce
from hetpipe_jax.baselines.gpipe import balanced_cuts, stage_memory
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.cluster import CATALOGUE, LINKS, Cluster, GpuType, make_cluster
from hetpipe_jax.cluster.catalogue import Link, model_family
from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.cost.memory import nbytes, stage_memory_bytes
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import full_size_input
from hetpipe_jax.sim.network import Simulator
from hetpipe_jax.studies.checked import progress
from hetpipe_jax.systems import get_system

TRAINING = ("horovod", "tf_replicated", "tf_replicated_copy", "ps_sync", "ps_replicated", "gpipe")  # rows may name
MODELLED = (*TRAINING, "nccl_allreduce")  # the systems a row can name and the simulator runs
FIT_SCOPES = ("setup", "type", "none")

Types = Mapping[str, GpuType]  # a catalogue of GPU types by name
Links = Mapping[str, Link]  # a catalogue of links by name


class Row(NamedTuple):
  """One published measurement (the CSV's columns)."""

  id: str
  category: str
  source: str
  setup: str
  gpu: str
  gpus: int
  nodes: int
  intra_link: str
  inter_link: str
  system: str
  model: str
  batch_per_gpu: int
  microbatches: int
  partitions: int
  precision: str
  figure: float
  unit: str
  one_gpu_figure: float | None
  baseline_batch: int
  message_bytes: float | None
  notes: str


def _number(text: str) -> float | None:
  return float(text) if text.strip() else None


def _count(text: str, default: int) -> int:
  return int(float(text)) if text.strip() else default


def read_table(path: str) -> list[Row]:
  """The table's rows.

  Raises:
    ConfigError: naming the file and row of a missing column, a bad number, or a GPU or link the catalogue
      does not have.
  """
  if not os.path.exists(path):
    raise ConfigError(f"--table={path}: no such file; give the CSV of published measurements")
  rows = []
  with open(path, newline="", encoding="utf-8") as f:
    for n, rec in enumerate(csv.DictReader(f), start=2):
      try:
        rows.append(Row(rec["id"], rec["category"], rec["source"], rec["setup"], rec["gpu"], _count(rec["gpus"], 1),
                        _count(rec["nodes"], 1), rec["intra_link"], rec["inter_link"], rec["system"],
                        rec["model"], _count(rec["batch_per_gpu"], 0), _count(rec["microbatches"], 0),
                        _count(rec["partitions"], 0), rec["precision"] or "fp32", float(rec["figure"]),
                        rec["unit"], _number(rec["one_gpu_figure"]),
                        _count(rec["baseline_batch"], 0), _number(rec["message_bytes"]), rec["notes"]))
      except (KeyError, ValueError) as e:
        raise ConfigError(f"{path} line {n}: {e!r}; every row needs the header's columns and numbers where "
                          "they are numbers") from e
      row = rows[-1]
      for what, name, known in (("gpu", row.gpu, CATALOGUE), ("intra_link", row.intra_link, LINKS),
                                ("inter_link", row.inter_link, LINKS)):
        if name not in known and (name or what != "inter_link"):  # (no inter_link: one node, or none named)
          raise ConfigError(f"{path} line {n}: {what}={name!r} is not in the catalogue; give one of "
                            f"{', '.join(sorted(known))}")
  return rows


def row_cluster(row: Row, types: Types, links: Links | None = None) -> Cluster:
  """The row's hardware: ``nodes`` nodes of ``gpus / nodes`` GPUs of its type, its links (of ``links``, the
  catalogue's by default)."""
  links = links or LINKS
  per_node = max(1, row.gpus // row.nodes)
  if row.nodes > 1 and not row.inter_link:
    raise ConfigError(f"{row.id}: {row.nodes} nodes and no inter_link: the source names no network the catalogue has")
  inter = links[row.inter_link or "ib_fdr56"]  # (one node: never used)
  return make_cluster(row.id, [[types[row.gpu]] * per_node for _ in range(row.nodes)], links[row.intra_link], inter)


def _costs(row: Row, weight_mode: str = "stash") -> CostContext:
  """Plain SGD (no optimizer slots), as every training row ran, in the row's precision, with the activations
  that PyTorch or TensorFlow (every row's framework) keep."""
  return CostContext(weight_mode=weight_mode, optimizer_slots=0, precision=row.precision, activations="eager")


def memory_need(row: Row, types: Types) -> int:
  """The bytes the memory model says the row's most loaded GPU needs, charged as the row's framework keeps
  activations (:func:`_costs`): the whole model at the row's batch on one GPU, or GPipe's stages (its
  microbatches checkpointed, :func:`hetpipe_jax.baselines.gpipe.stage_memory`) on the row's GPUs."""
  if row.system != "gpipe":
    return stage_memory_bytes(BatchProfiles.full_size(row.model, row.batch_per_gpu).at(row.batch_per_gpu), 1,
                              _costs(row, "latest"))
  micro = -(-row.batch_per_gpu // row.microbatches)  # (the largest microbatch, where they are unequal)
  profiles = BatchProfiles.full_size(row.model, micro).at(micro)
  cuts = balanced_cuts(profiles, [types[row.gpu]] * row.gpus, row.precision)
  return max(stage_memory(profiles, cuts, row.microbatches, nbytes(full_size_input(row.model, micro)), _costs(row)))


def memory_holds(row: Row, types: Types) -> bool:
  """Whether the memory model holds the row's training at its batch on its GPUs (:func:`memory_need`; a
  published row did: where this is false, the memory model is too strict for it, or the row is wrong)."""
  return types[row.gpu].memory_bytes >= memory_need(row, types)


def simulate(row: Row, types: Types, gpus: int | None = None, links: Links | None = None) -> float:
  """The row's throughput on the simulator (images/s, or seconds for a raw all-reduce), on ``gpus`` GPUs of one
  node instead of the row's when given (its one-GPU figure: ``gpus=1``).

  The row's GPUs held the model at its batch (it ran), so the simulated GPUs are not refused by the memory
  model, which validates time here, not memory (:func:`memory_holds` says where it would refuse).

  Raises:
    ConfigError: when the system cannot run the row.
  """
  if gpus is not None:
    row = row._replace(gpus=gpus, nodes=1)
  if row.system == "nccl_allreduce":
    cluster = row_cluster(row, types, links)
    sim, ended = Simulator(cluster), []
    allreduce(sim, cluster.gpus, row.message_bytes or 0.0, ended.append)
    sim.drain()
    return ended[0]
  held = dict(types)
  held[row.gpu] = dataclasses.replace(types[row.gpu], memory_bytes=1 << 62)
  batch, knobs = row.batch_per_gpu, PeerKnobs(rounds=1)  # (every round is the same)
  if row.system == "gpipe":  # (the row's batch is the pipeline's mini-batch, in its microbatches)
    knobs = knobs._replace(global_batch=row.batch_per_gpu, microbatches=row.microbatches)
    batch = row.batch_per_gpu // row.microbatches
  profiles = BatchProfiles.full_size(row.model, batch)
  run = get_system(row.system).simulate(row_cluster(row, held, links), profiles, batch, knobs, _costs(row), row.model)
  return run.images_per_sec


class FitPoint(NamedTuple):
  """A one-GPU figure a fit used: the published rate over the simulated one is the efficiency's factor."""

  id: str
  setup: str
  gpu: str
  model: str
  family: str
  batch: int
  published: float
  simulated_before: float
  ratio: float


class FitSkipped(NamedTuple):
  """A fit point the simulator could not run (the reason in ``skipped``)."""

  id: str
  gpu: str
  model: str
  skipped: str


class LinkFit(NamedTuple):
  """A two-GPU all-reduce a link's fit used, and the link fitted on it beside the catalogue's."""

  id: str
  setup: str
  link: str
  bytes_per_s: float
  latency_s: float
  catalogue_bytes_per_s: float
  catalogue_latency_s: float


FitRecord = FitPoint | FitSkipped | LinkFit


class Calibration(NamedTuple):
  """The fitted parameters: each setup's GPU types (``by_setup``; a setup without a fitted point of a type and
  family takes ``by_type``'s), the links of the setups whose intra-node link was fitted (``links``), one
  record per fitted point, and the rows whose own figure a fit used (``fitted``)."""

  by_type: Types
  by_setup: Mapping[str, Types]
  records: tuple[FitRecord, ...]
  scope: str
  links: Mapping[str, Links]
  fitted: frozenset[str]

  def types_for(self, row: Row) -> Types:
    """The GPU types that simulate ``row``."""
    return self.by_setup.get(row.setup, self.by_type)

  def links_for(self, row: Row) -> Links | None:
    """The links that simulate ``row`` (None: the catalogue's)."""
    return self.links.get(row.setup if self.scope == "setup" else row.intra_link)

  def is_fit_point(self, row: Row) -> bool:
    """Whether ``row``'s own figure is one a fit used (a one-GPU figure of a fit model, a two-GPU all-reduce;
    a multi-GPU row whose ``one_gpu_figure`` was used is not)."""
    return row.id in self.fitted


def _with_factors(types: Types, points: Mapping[tuple[str, str], list[float]]) -> dict[str, GpuType]:
  out = dict(types)
  for (gpu, family), ratios in points.items():
    t = CATALOGUE[gpu]
    factor = math.exp(statistics.mean(math.log(r) for r in ratios)) * t.efficiency_for(family)
    families = dict(out[gpu].family_efficiency)
    families[family] = factor
    out[gpu] = dataclasses.replace(out[gpu], family_efficiency=tuple(sorted(families.items())))
  return out


def _fit_points(rows: Sequence[Row], fit_models: Sequence[str]) -> list[FitPoint | FitSkipped]:
  """A record per distinct one-GPU figure of a fit model, simulated on the catalogue."""
  records: list[FitPoint | FitSkipped] = []
  seen = set()
  for row in rows:
    key = (row.setup, row.gpu, row.model, row.batch_per_gpu, row.precision, row.system)
    if row.system not in TRAINING or row.model not in fit_models or row.one_gpu_figure is None or key in seen:
      continue
    seen.add(key)
    try:
      simulated = simulate(row, CATALOGUE, gpus=1)
    except ConfigError as e:
      records.append(FitSkipped(row.id, row.gpu, row.model, str(e)))
      continue
    family = model_family(row.model)
    records.append(FitPoint(row.id, row.setup, row.gpu, row.model, family, row.batch_per_gpu, row.one_gpu_figure,
                            simulated, row.one_gpu_figure / simulated))
  return records


# The one-GPU rows whose figures the shipped catalogue's efficiencies of the issue-24 types were fitted on
# (hetpipe_jax/cluster/catalogue.py: `--fit=type` of 2026-12-05); ``--fit=none`` does not hold them out.
CATALOGUE_FIT_ROWS = frozenset({
    "lambda-1080ti-inc3-1", "lambda-1080ti-r50-1", "lambda-1080ti-vgg16-1", "lambda-2080ti-nop2p-inc3-1",
    "lambda-2080ti-nop2p-r50-1", "lambda-2080ti-nop2p-vgg16-1", "lambda-2080ti-nvlink-inc3-1",
    "lambda-2080ti-nvlink-r50-1", "lambda-2080ti-nvlink-vgg16-1", "nvrn50-dgx1-16g-amp-1", "nvrn50-dgx1-16g-fp32-1",
    "tfdoc-dgx1p100-vgg16-b32-1", "tfdoc-dgx1p100-vgg16-b64-1", "tfdoc-p28x-k80-r50-b32-1", "tfdoc-p28x-k80-r50-b64-1",
})


def fit_efficiency(rows: Sequence[Row], fit_models: Sequence[str], scope: str = "setup") -> Calibration:
  """Each GPU type's efficiency per model family, so that its simulated one-GPU rate on each fit model equals
  the published one (the roofline's time is inversely proportional to the efficiency: one ratio; several fit
  points: their geometric mean), per setup (``scope="setup"``: one machine and software stack of one source,
  the row's ``setup`` column), or per type over every setup (``"type"``), or none (``"none"``: the catalogue's, whose
  own fit rows, :data:`CATALOGUE_FIT_ROWS`, are then not held out).

  A fit point is a one-GPU row of a fit model, or a multi-GPU row's ``one_gpu_figure`` (the same setup's one-GPU
  run), simulated with the row's own system; every other figure is held out.
  """
  if scope not in FIT_SCOPES:
    raise ConfigError(f"--fit={scope!r}; give one of {', '.join(FIT_SCOPES)}")
  records: list[FitRecord] = list(_fit_points(rows, fit_models)) if scope != "none" else []
  by_type: dict[tuple[str, str], list[float]] = {}
  by_setup: dict[str, dict[tuple[str, str], list[float]]] = {}
  for r in records:
    if isinstance(r, FitPoint):
      by_type.setdefault((r.gpu, r.family), []).append(r.ratio)
      by_setup.setdefault(r.setup, {}).setdefault((r.gpu, r.family), []).append(r.ratio)
  typed = _with_factors(CATALOGUE, by_type)
  setups = {setup: _with_factors(typed, points) for setup, points in by_setup.items()} if scope == "setup" else {}
  links = _fit_links(rows, scope, records) if scope != "none" else {}
  by_id = {row.id: row for row in rows}
  fitted = frozenset(r.id for r in records
                     if (isinstance(r, FitPoint) and by_id[r.id].gpus == 1) or isinstance(r, LinkFit))
  if scope == "none":  # the catalogue as shipped was fitted on these: they are not held out
    fitted = CATALOGUE_FIT_ROWS & frozenset(by_id)
  return Calibration(typed, setups, tuple(records), scope, links, fitted)


def _fit_link(fit: Sequence[Row]) -> tuple[float, float] | None:
  """(bytes per second, latency) of a two-GPU ring, 2 a + S / B for S bytes, least squares in relative error
  over ``fit``'s times (a >= 0, else 1 / B alone); None when they do not determine it."""
  us, vs = [2 / r.figure for r in fit], [(r.message_bytes or 0.0) / r.figure for r in fit]  # (target: 1 each)
  suu, svv, suv = sum(u * u for u in us), sum(v * v for v in vs), sum(u * v for u, v in zip(us, vs))
  det = suu * svv - suv * suv
  if len(fit) < 2 or det <= 0:
    return None
  latency, slope = (svv * sum(us) - suv * sum(vs)) / det, (suu * sum(vs) - suv * sum(us)) / det
  if latency < 0:
    latency, slope = 0.0, sum(vs) / svv
  return 1 / slope, latency


def _fit_links(rows: Sequence[Row], scope: str, records: list[FitRecord]) -> dict[str, Links]:
  """The intra-node link's bandwidth B and latency a fitted on the two-GPU all-reduce times of one node, per
  setup (or per link, ``scope="type"``), a record per time used appended to ``records``; the sizes span three
  decades, so the errors are relative. Every larger all-reduce is held out."""
  points: dict[str, list[Row]] = {}
  for row in rows:
    if row.system == "nccl_allreduce" and row.gpus == 2 and row.nodes == 1 and row.message_bytes:
      points.setdefault(row.setup if scope == "setup" else row.intra_link, []).append(row)
  out = {}
  for key, fit in points.items():
    fitted = _fit_link(fit)
    if fitted is None:
      continue
    bytes_per_s, latency = fitted
    name = fit[0].intra_link
    links = dict(LINKS)
    links[name] = Link(name, bytes_per_s, latency)
    out[key] = links
    for r in fit:
      records.append(LinkFit(r.id, r.setup, name, bytes_per_s, latency, LINKS[name].bytes_per_s,
                             LINKS[name].latency_s))
  return out


class Entry(NamedTuple):
  """A row simulated on its setup's catalogue: its figure, the error, the scaling efficiencies (where it has
  them), whether a fit used it, whether the memory model holds its batch (a training row that ran), and why it
  did not run (``reason``)."""

  row: Row
  simulated: float | None = None
  error: float | None = None  # simulated / published - 1
  reason: str | None = None
  fitted: bool = False
  memory_model_holds: bool | None = None
  published_scaling: float | None = None
  simulated_scaling: float | None = None
  scaling_error: float | None = None  # simulated - published scaling efficiency

  @property
  def id(self) -> str:
    return self.row.id


OPTIONAL = ("memory_model_holds", "published_scaling", "simulated_scaling", "scaling_error")  # JSON: where set


def entry_json(entry: Entry) -> dict[str, Any]:
  """An entry as validate_published.json holds it: the row's columns, then what was simulated (the optional
  fields only where set)."""
  out = {**entry.row._asdict(), "simulated": entry.simulated, "error": entry.error, "reason": entry.reason,
         "fitted": entry.fitted}
  out.update((k, getattr(entry, k)) for k in OPTIONAL if getattr(entry, k) is not None)
  return out


def _scaling(row: Row, simulated: float, one: float | None, types: Types, links: Links | None) -> Entry:
  """The entry of a row that ran: ``simulated`` in the row's unit (``one``: its GPUs' one-GPU figure)."""
  entry = Entry(row, memory_model_holds=memory_holds(row, types) if row.system in TRAINING else None)
  if row.unit == "speedup":  # over one GPU's plain training at the baseline's batch
    simulated /= simulate(row._replace(system="horovod", batch_per_gpu=row.baseline_batch or row.batch_per_gpu),
                          types, gpus=1, links=links)
  elif row.unit == "scaling_efficiency" and one is not None:  # N-GPU images/s over N x one GPU's
    simulated = simulated / (row.gpus * one)
    entry = entry._replace(published_scaling=row.figure, simulated_scaling=simulated)
  elif one is not None and row.one_gpu_figure:
    entry = entry._replace(published_scaling=row.figure / (row.gpus * row.one_gpu_figure),
                           simulated_scaling=simulated / (row.gpus * one))
  if entry.simulated_scaling is not None and entry.published_scaling is not None:
    entry = entry._replace(scaling_error=entry.simulated_scaling - entry.published_scaling)
  return entry._replace(simulated=simulated, error=simulated / row.figure - 1)


def evaluate_row(row: Row, calibration: Calibration) -> Entry:
  """One row simulated on its setup's catalogue (:class:`Entry`)."""
  fitted = calibration.is_fit_point(row)
  if row.system not in MODELLED:
    return Entry(row, reason=f"system {row.system or '(none named)'!r} not modelled", fitted=fitted)
  types, links = calibration.types_for(row), calibration.links_for(row)
  try:
    simulated = simulate(row, types, links=links)
    one = None  # the same GPUs' one-GPU figure (a data-parallel row of more GPUs runs on one)
    if row.gpus > 1 and row.system in TRAINING and row.system != "gpipe":
      one = simulate(row, types, gpus=1, links=links)
  except ConfigError as e:
    return Entry(row, reason=str(e), fitted=fitted)
  entry = _scaling(row, simulated, one, types, links)._replace(fitted=fitted)
  progress("%s: published %.4g, simulated %.4g (%+.1f%%)", row.id, row.figure, entry.simulated,
           100 * (entry.error or 0.0))
  return entry


def evaluate(rows: Sequence[Row], calibration: Calibration) -> list[Entry]:
  """Every row simulated on its setup's catalogue: its figure, the error, the scaling efficiencies, whether a
  fit used it, and whether the memory model holds its batch."""
  return [evaluate_row(row, calibration) for row in rows]


class ErrorStats(NamedTuple):
  """Absolute errors over some entries that ran (None: no entry, or none with a scaling efficiency)."""

  cases: int
  median_error: float | None
  worst_error: float | None
  median_scaling_error: float | None
  worst_scaling_error: float | None


class Summary(NamedTuple):
  """Errors over the held-out rows that ran, over the fitted ones, and per category (held out); the training
  rows, and the ids of those the memory model refuses (:func:`memory_holds`)."""

  held_out: ErrorStats
  fitted: ErrorStats
  per_category: Mapping[str, ErrorStats]
  not_run: int
  training_rows: int = 0
  memory_refused: tuple[str, ...] = ()


def error_stats(entries: Sequence[Entry]) -> ErrorStats:
  errs = [abs(e.error) for e in entries if e.error is not None]
  scal = [abs(e.scaling_error) for e in entries if e.scaling_error is not None]
  return ErrorStats(len(entries), statistics.median(errs) if errs else None, max(errs) if errs else None,
                    statistics.median(scal) if scal else None, max(scal) if scal else None)


def summary(entries: Sequence[Entry]) -> Summary:
  """Errors over the held-out rows that ran, overall and per category."""
  held = [e for e in entries if e.error is not None and not e.fitted]
  fitted = [e for e in entries if e.error is not None and e.fitted]
  return Summary(error_stats(held), error_stats(fitted),
                 {c: error_stats([e for e in held if e.row.category == c])
                  for c in dict.fromkeys(e.row.category for e in held)},
                 len([e for e in entries if e.error is None]),
                 len([e for e in entries if e.memory_model_holds is not None]),
                 tuple(e.id for e in entries if e.memory_model_holds is False))


def summary_json(s: Summary) -> dict[str, Any]:
  """A summary as validate_published.json holds it."""
  return {"held_out": s.held_out._asdict(), "fitted": s.fitted._asdict(),
          "per_category": {c: v._asdict() for c, v in s.per_category.items()}, "not_run": s.not_run,
          "training_rows": s.training_rows, "memory_refused": list(s.memory_refused)}
