"""The WSP check every study runs on every trace it makes: a breach is a bug in the runtime, never bad input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from absl import logging

from hetpipe_jax.core import check


class TraceCheckError(RuntimeError):
  """A run's trace breaks a WSP guarantee: a bug in the runtime, never bad input."""


def require_wsp(events: Sequence[dict[str, Any]], what: str) -> None:
  """Runs the trace checker on a run's events (:func:`hetpipe_jax.core.check.require_wsp`).

  Args:
    events: the run's trace.
    what: names the run in the error, e.g. "HetPipe D=4".

  Raises:
    TraceCheckError: with the number of violations and the first three, when a WSP guarantee fails.
  """
  check.require_wsp(events, what, TraceCheckError)


def require_sound(violations: Sequence[check.Violation], what: str) -> None:
  """:func:`require_wsp` of violations already found (a trace checked as it was emitted)."""
  check.raise_violations(violations, what, TraceCheckError)


def progress(message: str, *args: Any) -> None:
  """Logs a study's progress line (absl INFO on stderr; stdout keeps the results), attributed to the caller."""
  logging.info(message, *args)


logging.ABSLLogger.register_frame_to_skip(__file__, "progress")
