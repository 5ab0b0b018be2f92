"""The throughput study on the simulated cluster as library code: HetPipe against its peers, one table per model
(:func:`run_throughput`: a :class:`ThroughputConfig` in, a :class:`ThroughputResult` out).

For each model the table holds the systems of ``config.systems`` (:mod:`hetpipe_jax.systems`: simulated on the same
network, cost model and memory model), HetPipe NP, ED and HD at every Nm rule of ``config.nms`` and every D of
``config.ds`` (the planner's partitions and Nm, on the ``sim`` executor), and with ``config.tuned`` the tuner's
rows (``HetPipe tuned``, ``HetPipe tuned for images/s``, ``HetPipe tuned + outer``); each row's goodput mark comes
from the convergence studies given (:mod:`hetpipe_jax.studies.throughput_goodput`). The sub-studies outside the
table: ``nm`` (one virtual worker as Nm grows), ``closed_form`` (the closed-form Horovod estimate), ``whimpy``
(HetPipe without the whimpy GPUs).
``experiments.throughput`` turns its flags into a :class:`ThroughputConfig` and writes the files.

The configuration, the records and the per-model state are in :mod:`hetpipe_jax.studies.throughput_records`, the
table's rows in :mod:`hetpipe_jax.studies.throughput_table`, the sub-studies in
:mod:`hetpipe_jax.studies.throughput_substudies`; this module runs them, model by model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hetpipe_jax.cost.batch import BatchProfiles
from hetpipe_jax.studies.throughput_breakdown import best_row_breakdowns
from hetpipe_jax.studies.throughput_records import ModelStudy, ModelTable, Progress, ThroughputConfig, ThroughputResult
from hetpipe_jax.studies.throughput_substudies import closed_form_horovod, nm_rows, whimpy_rows
from hetpipe_jax.studies.throughput_table import finish_table, headline, hetpipe_entries, peer_entries, tuned_entries

ProfilesOf = Callable[[str, int, "int | None"], tuple[BatchProfiles, int, str]]  # (model, batch, seq_len) ->


def study_model(config: ThroughputConfig, model: str, profiles: tuple[BatchProfiles, int, str],
                convergence: list[dict[str, Any]], say: Progress) -> ModelTable:
  """One model: the table (peers, HetPipe policies, tuned rows, goodput) and the sub-studies."""
  s = ModelStudy(config, model, profiles, convergence, say)
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
                    s.rows, s.convergence, best_row_breakdowns(s.table, s.ran))


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
  return ThroughputResult(config.cluster.name, config.tuned_objective, list(convergence_paths), models,
                          config.recompute)
