"""What a multi-process run would refuse, refused once before any process is launched.

A launched process validates its :class:`~hetpipe_jax.run.config.RunConfig` only after it has joined the job
(the coordination service, its devices): a value its executor does not run (``placement=striped`` on the
``multiprocess`` executor) then ends every process, each with the coordination service's tracebacks. The
launcher calls :func:`refuse_before_launch` first: one line, a non-zero exit, nothing started.
"""

from __future__ import annotations

from hetpipe_jax.run.config import RunConfig
from hetpipe_jax.run.executors import get_executor


def refuse_before_launch(config: RunConfig) -> None:
  """Validates ``config`` as every launched process will (its own fields, then its executor's rules).

  Raises:
    ConfigError: naming the value and what to change.
  """
  config.validate()
  get_executor(config.executor).validate(config)
