"""The throughput study's goodput marks: whether a row of its table reached the target in a convergence study
(``convergence.json``), matched by row and, for a row trained in another configuration, by its signature."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.systems import System, systems

REACHES, MISSES, NOT_TRAINED = "reaches", "misses", "not trained"  # goodput marks (:func:`goodput`)


def run_signature(run: dict) -> list:
  """What identifies a convergence run's configuration, as its system reads it
  (:meth:`~hetpipe_jax.systems.base.System.entry_signature`; a system not registered: as a peer's)."""
  known = systems()
  return (known.get(run.get("system", "")) or System).entry_signature(run)


def goodput(docs: list[dict], row: str, signature: list | None = None, strict: bool = False
            ) -> tuple[str, float | None]:
  """(the mark of ``row`` in the first of ``docs`` that trained it, its mean time to target). A convergence
  study that trained this row in another configuration (another ``signature``) does not mark it; with ``strict``
  (a row looked up under another row's name) only runs that record ``signature`` do, never a summary alone."""
  for doc in docs:
    runs = [r for r in doc.get("runs", []) if r.get("row") == row]
    if signature is not None and runs and ("nm" in runs[0] or strict):
      runs = [r for r in runs if run_signature(r) == signature]
      if not runs:
        return f"{NOT_TRAINED} (the convergence study trained another configuration)", None
    if runs:
      times = [r.get("time_to_target_s") for r in runs]
      if any(t is None for t in times):
        return MISSES, None
      return REACHES, sum(times) / len(times)
    if strict:
      continue
    entry = next((v for v in doc["summary"].values() if isinstance(v, dict) and v.get("row") == row), None)
    if entry is not None:
      missed = entry.get("missed", 0)
      missed = len(missed) if isinstance(missed, list) else int(missed)
      return (MISSES if missed else REACHES), entry.get("mean_time_to_target_s")
  return NOT_TRAINED, None


def convergence_docs(paths: Sequence[str]) -> list[dict[str, Any]]:
  """The convergence.json files of ``paths``, each with its ``path``.

  Raises:
    ConfigError: for a file that is missing or not a convergence.json.
  """
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
