"""The published measurements and how the simulator runs them: the table, the clusters, the fit and the
errors of :mod:`experiments.validate_published` (no flags here, so that tests import it beside other
experiments)."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
from typing import Any, NamedTuple

from experiments import common

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published.csv")
TRAINING = ("horovod", "tf_replicated", "tf_replicated_copy", "ps_sync", "ps_replicated", "gpipe")  # rows may name
MODELLED = (*TRAINING, "nccl_allreduce")  # the systems a row can name and the simulator runs


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
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import CATALOGUE, LINKS
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


def row_cluster(row: Row, types: dict, links: dict | None = None):
  """The row's hardware: ``nodes`` nodes of ``gpus / nodes`` GPUs of its type, its links (of ``links``, the
  catalogue's by default)."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import LINKS, make_cluster
  links = links or LINKS
  per_node = max(1, row.gpus // row.nodes)
  if row.nodes > 1 and not row.inter_link:
    raise ConfigError(f"{row.id}: {row.nodes} nodes and no inter_link: the source names no network the catalogue has")
  inter = links[row.inter_link or "ib_fdr56"]  # (one node: never used)
  return make_cluster(row.id, [[types[row.gpu]] * per_node for _ in range(row.nodes)], links[row.intra_link], inter)


def _costs(row: Row, weight_mode: str = "stash"):
  """Plain SGD (no optimizer slots), as every training row ran, in the row's precision."""
  from hetpipe_jax.cost.context import CostContext
  return CostContext(weight_mode=weight_mode, optimizer_slots=0, precision=row.precision)


def memory_holds(row: Row, types: dict) -> bool:
  """Whether the memory model says one GPU of the row's type holds the model at the row's batch (a published
  row did: where this is false, the memory model is too strict for it)."""
  from hetpipe_jax.cost.batch import BatchProfiles
  from hetpipe_jax.cost.memory import stage_memory_bytes
  profiles = BatchProfiles.full_size(row.model, row.batch_per_gpu).at(row.batch_per_gpu)
  need = stage_memory_bytes(profiles, 1, _costs(row, "latest"))
  return types[row.gpu].memory_bytes >= need


def simulate(row: Row, types: dict, gpus: int | None = None, links: dict | None = None) -> float:
  """The row's throughput on the simulator (images/s, or seconds for a raw all-reduce), on ``gpus`` GPUs of one
  node instead of the row's when given (its one-GPU figure: ``gpus=1``).

  The row's GPUs held the model at its batch (it ran), so the simulated GPUs are not refused by the memory
  model, which validates time here, not memory (:func:`memory_holds` says where it would refuse).

  Raises:
    ConfigError: when the system cannot run the row.
  """
  from hetpipe_jax.baselines.knobs import PeerKnobs
  from hetpipe_jax.cost.batch import BatchProfiles
  from hetpipe_jax.systems import get_system
  if gpus is not None:
    row = row._replace(gpus=gpus, nodes=1)
  if row.system == "nccl_allreduce":
    from hetpipe_jax.baselines.collective import allreduce
    from hetpipe_jax.sim.network import Simulator
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


FIT_SCOPES = ("setup", "type", "none")


class Calibration(NamedTuple):
  """The fitted parameters: each setup's GPU types (``by_setup``; a setup without a fitted point of a type and
  family takes ``by_type``'s), the links of the setups whose intra-node link was fitted (``links``), one
  record per fitted point, and the rows whose own figure a fit used (``fitted``)."""

  by_type: dict
  by_setup: dict[str, dict]
  records: list[dict]
  scope: str
  links: dict[str, dict]
  fitted: frozenset[str]

  def types_for(self, row: Row) -> dict:
    """The GPU types that simulate ``row``."""
    return self.by_setup.get(row.setup, self.by_type)

  def links_for(self, row: Row) -> dict | None:
    """The links that simulate ``row`` (None: the catalogue's)."""
    return self.links.get(row.setup if self.scope == "setup" else row.intra_link)

  def is_fit_point(self, row: Row) -> bool:
    """Whether ``row``'s own figure is one a fit used (a one-GPU figure of a fit model, a two-GPU all-reduce;
    a multi-GPU row whose ``one_gpu_figure`` was used is not)."""
    return row.id in self.fitted


def _with_factors(types: dict, points: dict[tuple[str, str], list[float]]) -> dict:
  from hetpipe_jax.cluster import CATALOGUE
  out = dict(types)
  for (gpu, family), ratios in points.items():
    t = CATALOGUE[gpu]
    factor = math.exp(statistics.mean(math.log(r) for r in ratios)) * t.efficiency_for(family)
    families = dict(out[gpu].family_efficiency)
    families[family] = factor
    out[gpu] = dataclasses.replace(out[gpu], family_efficiency=tuple(sorted(families.items())))
  return out


def fit_efficiency(rows: list[Row], fit_models: list[str], scope: str = "setup") -> Calibration:
  """Each GPU type's efficiency per model family, so that its simulated one-GPU rate on each fit model equals
  the published one (the roofline's time is inversely proportional to the efficiency: one ratio; several fit
  points: their geometric mean), per setup (``scope="setup"``: one machine and software stack of one source,
  the row's ``setup`` column), or per type over every setup (``"type"``), or none (``"none"``: the catalogue's).

  A fit point is a one-GPU row of a fit model, or a multi-GPU row's ``one_gpu_figure`` (the same setup's one-GPU
  run), simulated with the row's own system; every other figure is held out.
  """
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import CATALOGUE
  from hetpipe_jax.cluster.catalogue import model_family
  if scope not in FIT_SCOPES:
    raise ConfigError(f"--fit={scope!r}; give one of {', '.join(FIT_SCOPES)}")
  by_type: dict[tuple[str, str], list[float]] = {}
  by_setup: dict[str, dict[tuple[str, str], list[float]]] = {}
  records: list[dict] = []
  seen = set()
  for row in rows if scope != "none" else []:
    key = (row.setup, row.gpu, row.model, row.batch_per_gpu, row.precision, row.system)
    if row.system not in TRAINING or row.model not in fit_models or row.one_gpu_figure is None or key in seen:
      continue
    seen.add(key)
    try:
      simulated = simulate(row, CATALOGUE, gpus=1)
    except ConfigError as e:
      records.append({"id": row.id, "gpu": row.gpu, "model": row.model, "skipped": str(e)})
      continue
    family, ratio = model_family(row.model), row.one_gpu_figure / simulated
    by_type.setdefault((row.gpu, family), []).append(ratio)
    by_setup.setdefault(row.setup, {}).setdefault((row.gpu, family), []).append(ratio)
    records.append({"id": row.id, "setup": row.setup, "gpu": row.gpu, "model": row.model, "family": family,
                    "batch": row.batch_per_gpu, "published": row.one_gpu_figure, "simulated_before": simulated,
                    "ratio": ratio})
  typed = _with_factors(dict(CATALOGUE), by_type)
  setups = {setup: _with_factors(typed, points) for setup, points in by_setup.items()} if scope == "setup" else {}
  links = _fit_links(rows, scope, records) if scope != "none" else {}
  by_id = {row.id: row for row in rows}
  fitted = frozenset(r["id"] for r in records if ("ratio" in r and by_id[r["id"]].gpus == 1) or "link" in r)
  return Calibration(typed, setups, records, scope, links, fitted)


def _fit_links(rows: list[Row], scope: str, records: list[dict]) -> dict[str, dict]:
  """The intra-node link's bandwidth B and latency a fitted on the two-GPU all-reduce times of one node, per
  setup (or per link, ``scope="type"``): a two-GPU ring takes 2 a + S / B for S bytes; a and 1 / B minimise the
  squared relative errors (the sizes span three decades; a >= 0, else 1 / B alone). Every larger all-reduce is
  held out."""
  from hetpipe_jax.cluster import LINKS
  from hetpipe_jax.cluster.catalogue import Link
  points: dict[str, list[Row]] = {}
  for row in rows:
    if row.system == "nccl_allreduce" and row.gpus == 2 and row.nodes == 1 and row.message_bytes:
      points.setdefault(row.setup if scope == "setup" else row.intra_link, []).append(row)
  out = {}
  for key, fit in points.items():
    us, vs = [2 / r.figure for r in fit], [(r.message_bytes or 0.0) / r.figure for r in fit]  # (target: 1 each)
    suu, svv, suv = sum(u * u for u in us), sum(v * v for v in vs), sum(u * v for u, v in zip(us, vs))
    det = suu * svv - suv * suv
    if len(fit) < 2 or det <= 0:
      continue
    latency, slope = (svv * sum(us) - suv * sum(vs)) / det, (suu * sum(vs) - suv * sum(us)) / det
    if latency < 0:
      latency, slope = 0.0, sum(vs) / svv
    name = fit[0].intra_link
    links = dict(LINKS)
    links[name] = Link(name, 1 / slope, latency)
    out[key] = links
    for r in fit:
      records.append({"id": r.id, "setup": r.setup, "link": name, "bytes_per_s": 1 / slope, "latency_s": latency,
                      "catalogue_bytes_per_s": LINKS[name].bytes_per_s, "catalogue_latency_s": LINKS[name].latency_s})
  return out


def evaluate(rows: list[Row], calibration: Calibration) -> list[dict]:
  """Every row simulated on its setup's catalogue: its figure, the error, the scaling efficiencies, whether a
  fit used it, and whether the memory model holds its batch."""
  from hetpipe_jax import ConfigError
  out = []
  for row in rows:
    entry: dict[str, Any] = {**row._asdict(), "simulated": None, "error": None, "reason": None}
    entry["fitted"] = calibration.is_fit_point(row)
    if row.system not in MODELLED:
      entry["reason"] = f"system {row.system or '(none named)'!r} not modelled"
      out.append(entry)
      continue
    types, links = calibration.types_for(row), calibration.links_for(row)
    try:
      simulated = simulate(row, types, links=links)
      one = None  # the same GPUs' one-GPU figure (a data-parallel row of more GPUs runs on one)
      if row.gpus > 1 and row.system in TRAINING and row.system != "gpipe":
        one = simulate(row, types, gpus=1, links=links)
    except ConfigError as e:
      entry["reason"] = str(e)
      out.append(entry)
      continue
    if row.system in TRAINING:
      entry["memory_model_holds"] = memory_holds(row, types)
    if row.unit == "speedup":  # over one GPU's plain training at the baseline's batch
      simulated /= simulate(row._replace(system="horovod", batch_per_gpu=row.baseline_batch or row.batch_per_gpu),
                            types, gpus=1, links=links)
    elif row.unit == "scaling_efficiency" and one is not None:  # N-GPU images/s over N x one GPU's
      entry["published_scaling"], simulated = row.figure, simulated / (row.gpus * one)
      entry["simulated_scaling"] = simulated
    elif one is not None and row.one_gpu_figure:
      entry["published_scaling"] = row.figure / (row.gpus * row.one_gpu_figure)
      entry["simulated_scaling"] = simulated / (row.gpus * one)
    if "simulated_scaling" in entry:
      entry["scaling_error"] = entry["simulated_scaling"] - entry["published_scaling"]
    entry["simulated"] = simulated
    entry["error"] = simulated / row.figure - 1
    common.progress("%s: published %.4g, simulated %.4g (%+.1f%%)", row.id, row.figure, simulated,
                    100 * entry["error"])
    out.append(entry)
  return out


def summary(entries: list[dict]) -> dict[str, Any]:
  """Errors over the held-out rows that ran, overall and per category."""
  held = [e for e in entries if e["error"] is not None and not e["fitted"]]
  fitted = [e for e in entries if e["error"] is not None and e["fitted"]]

  def stats(es):
    errs = [abs(e["error"]) for e in es]
    scal = [abs(e["scaling_error"]) for e in es if "scaling_error" in e]
    return {"cases": len(es), "median_error": statistics.median(errs) if errs else None,
            "worst_error": max(errs) if errs else None,
            "median_scaling_error": statistics.median(scal) if scal else None,
            "worst_scaling_error": max(scal) if scal else None}

  return {"held_out": stats(held), "fitted": stats(fitted),
          "per_category": {c: stats([e for e in held if e["category"] == c])
                           for c in dict.fromkeys(e["category"] for e in held)},
          "not_run": len([e for e in entries if e["error"] is None])}


