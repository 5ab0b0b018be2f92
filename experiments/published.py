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
PEER_OF = {"allreduce": "horovod", "ps_sync": "ps_sync"}  # the row's system -> the peer that simulates it
MODELLED = (*PEER_OF, "nccl_allreduce")  # the systems a row can name and the simulator runs


class Row(NamedTuple):
  """One published measurement (the CSV's columns)."""

  id: str
  category: str
  source: str
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
        rows.append(Row(rec["id"], rec["category"], rec["source"], rec["gpu"], _count(rec["gpus"], 1),
                        _count(rec["nodes"], 1), rec["intra_link"], rec["inter_link"], rec["system"],
                        rec["model"], _count(rec["batch_per_gpu"], 0), _count(rec["microbatches"], 0),
                        _count(rec["partitions"], 0), rec["precision"] or "fp32", float(rec["figure"]),
                        rec["unit"], _number(rec["one_gpu_figure"]), _number(rec["message_bytes"]), rec["notes"]))
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


def row_cluster(row: Row, types: dict):
  """The row's hardware: ``nodes`` nodes of ``gpus / nodes`` GPUs of its type, its links."""
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import LINKS, make_cluster
  per_node = max(1, row.gpus // row.nodes)
  if row.nodes > 1 and not row.inter_link:
    raise ConfigError(f"{row.id}: {row.nodes} nodes and no inter_link: the source names no network the catalogue has")
  inter = LINKS[row.inter_link or "ib_fdr56"]  # (one node: never used)
  return make_cluster(row.id, [[types[row.gpu]] * per_node for _ in range(row.nodes)], LINKS[row.intra_link], inter)


def simulate(row: Row, types: dict, gpus: int | None = None) -> float:
  """The row's figure on the simulator (images/s, or seconds for a raw all-reduce), on ``gpus`` GPUs of one
  node instead of the row's when given (its one-GPU figure: ``gpus=1``).

  Raises:
    ConfigError: when the system cannot run the row (e.g. no GPU holds the model at its batch).
  """
  from hetpipe_jax.baselines.knobs import PeerKnobs
  from hetpipe_jax.baselines.systems import simulate_peer
  from hetpipe_jax.cost.batch import BatchProfiles
  from hetpipe_jax.cost.context import CostContext
  if gpus is not None:
    row = row._replace(gpus=gpus, nodes=1)
  cluster = row_cluster(row, types)
  if row.system == "nccl_allreduce":
    from hetpipe_jax.baselines.collective import allreduce
    from hetpipe_jax.sim.network import Simulator
    sim, ended = Simulator(cluster), []
    allreduce(sim, cluster.gpus, row.message_bytes or 0.0, ended.append)
    sim.drain()
    return ended[0]
  profiles = BatchProfiles.full_size(row.model, row.batch_per_gpu)
  run = simulate_peer(PEER_OF[row.system], cluster, profiles, row.batch_per_gpu, PeerKnobs(),
                      CostContext(optimizer_slots=0, precision=row.precision), row.model)
  return run.images_per_sec


def fit_efficiency(rows: list[Row], fit_models: list[str]) -> tuple[dict, list[dict]]:
  """Each GPU type's efficiency per family, so that its simulated one-GPU rate on each fit model equals the
  published one (the roofline's time is inversely proportional to the efficiency: one ratio; several fit
  rows of a type and family: their geometric mean).

  Returns:
    The catalogue's types with the fitted factors, and one record per fitted point.
  """
  from hetpipe_jax import ConfigError
  from hetpipe_jax.cluster import CATALOGUE
  from hetpipe_jax.cluster.catalogue import model_family
  points: dict[tuple[str, str], list[float]] = {}
  records = []
  seen = set()
  for row in rows:
    key = (row.gpu, row.model, row.batch_per_gpu, row.intra_link, row.precision, row.source)
    if row.system not in PEER_OF or row.model not in fit_models or row.one_gpu_figure is None or key in seen:
      continue
    seen.add(key)
    try:
      simulated = simulate(row, CATALOGUE, gpus=1)
    except ConfigError as e:
      records.append({"gpu": row.gpu, "model": row.model, "batch": row.batch_per_gpu, "skipped": str(e)})
      continue
    family = model_family(row.model)
    ratio = row.one_gpu_figure / simulated
    points.setdefault((row.gpu, family), []).append(ratio)
    records.append({"gpu": row.gpu, "model": row.model, "family": family, "batch": row.batch_per_gpu,
                    "published": row.one_gpu_figure, "simulated_before": simulated, "ratio": ratio})
  types = dict(CATALOGUE)
  for (gpu, family), ratios in points.items():
    t = types[gpu]
    factor = math.exp(statistics.mean(math.log(r) for r in ratios)) * t.efficiency_for(family)
    families = dict(t.family_efficiency)
    families[family] = factor
    types[gpu] = dataclasses.replace(t, family_efficiency=tuple(sorted(families.items())))
  return types, records


def evaluate(rows: list[Row], types: dict, fit_models: list[str], fitted: bool = True) -> list[dict]:
  """Every row simulated: its figure, the error, the scaling efficiencies, and whether a fit used it
  (``fitted``: the efficiencies were fitted on ``fit_models``)."""
  from hetpipe_jax import ConfigError
  out = []
  for row in rows:
    entry: dict[str, Any] = {**row._asdict(), "simulated": None, "error": None, "reason": None}
    single = row.gpus == 1
    entry["fitted"] = bool(fitted and single and row.model in fit_models and row.system in PEER_OF)
    if row.system not in MODELLED:
      entry["reason"] = f"system {row.system!r} not modelled yet"
      out.append(entry)
      continue
    try:
      simulated = simulate(row, types)
    except ConfigError as e:
      entry["reason"] = str(e)
      out.append(entry)
      continue
    entry["simulated"] = simulated
    entry["error"] = simulated / row.figure - 1
    if row.one_gpu_figure and row.gpus > 1 and row.unit == "images_per_sec":
      one = simulate(row, types, gpus=1)  # (it ran on more GPUs of the same kind: it runs on one)
      entry["published_scaling"] = row.figure / (row.gpus * row.one_gpu_figure)
      entry["simulated_scaling"] = simulated / (row.gpus * one)
      entry["scaling_error"] = entry["simulated_scaling"] - entry["published_scaling"]
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


