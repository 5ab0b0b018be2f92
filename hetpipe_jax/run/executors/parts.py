"""What the runs of the ``multiprocess`` executor that go in parts share: HetPipe adapting live
(:mod:`~hetpipe_jax.run.executors.live_replan`), and checkpointed and ``--rejoin`` runs
(:mod:`~hetpipe_jax.run.executors.continued`). A part is a decentralised WSP run of its own in the same processes
(:class:`~hetpipe_jax.runtime.processes.job.DecentralJob`) in which every virtual worker runs the part's waves, so
every part ends drained; after it, process 0 hands every other process what the next part starts from."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hetpipe_jax.errors import RunStopped
from hetpipe_jax.plan.layout import Layout
from hetpipe_jax.run.session import require_pushes
from hetpipe_jax.run.setup import Setup
from hetpipe_jax.runtime.numerics.metrics import WaveMetrics, replay_metrics
from hetpipe_jax.runtime.transport.mailbox import TIMEOUT_S, Mailbox, receive_tree, send_tree
from hetpipe_jax.runtime.transport.node import POLL_S, Node


class Ran(NamedTuple):
  """What one part left on process 0: its merged events, gathered weights (in order; the last are the part's final
  weights), its start and end in seconds since the run's first part started, and the processes it went on
  without."""

  events: list[dict[str, Any]]
  gathers: list[tuple[Any, ...]]
  start: float
  end: float
  missing: tuple[int, ...] = ()


class PartAt(NamedTuple):
  """Where a part sits in a run that continues one trace (:mod:`~hetpipe_jax.run.executors.continued`).

  Attributes:
    first: the waves every virtual worker ran before the part: its evaluation ticks count from them.
    run_waves: the run's waves (0: the part is all of it, or its trace stands alone).
    before: the run's trace goes on: its times are seconds since the run's first part started plus ``before``
      (the seconds of the run before a resume); None: the part's trace has its own clock.
  """

  first: int = 0
  run_waves: int = 0
  before: float | None = None


# (setup of the part, its initial weights, streams' minibatches already taken, last part?, a layout to compile
# meanwhile, where the part sits) -> process 0's Ran (None elsewhere)
RunPart = Callable[[Setup, tuple[Any, ...], Sequence[int], bool, Layout | None, PartAt], Ran | None]


def hand_out(node: Node, key: str, info: dict[str, Any], params: tuple[Any, ...]) -> None:
  """Process 0: publishes ``info`` (JSON) under ``key`` (scoped to the part just ended) and sends every other process
  the next part's weights."""
  node.put(node.scoped(key), json.dumps(info))
  for p in range(1, node.num_processes):
    send_tree(node, Mailbox(), p, "next_weights", params)


def handed(node: Node, key: str) -> tuple[dict[str, Any], tuple[Any, ...]]:
  """Any other process: what process 0 handed out (:func:`hand_out`).

  Raises:
    RunStopped: when process 0 stopped the job instead.
    TimeoutError: when nothing came within ``TIMEOUT_S``.
  """
  deadline = time.monotonic() + TIMEOUT_S
  while True:
    try:
      info = node.get(node.scoped(key), POLL_S)  # (at once when it is there)
      break
    except TimeoutError:
      if node.recoverable and node.stopping():
        raise RunStopped("process 0 stopped the job between two parts") from None
      if time.monotonic() > deadline:
        raise
  return json.loads(info), tuple(receive_tree(node, Mailbox(), 0, "next_weights"))


def part_metrics(setup: Setup, ran: Ran) -> WaveMetrics:
  """A part's metrics (not evaluated yet), replayed from its trace with its gathered weights.

  Raises:
    RunStopped: when no wave was pushed.
  """
  c = setup.config
  metrics = replay_metrics(ran.events, ran.gathers, setup.layout.nms, c.waves, c.eval_every)
  require_pushes(metrics.rows)
  return metrics


def shifted_rows(rows: list[dict[str, Any]], done: int, taken: Sequence[int], start: float) -> list[dict[str, Any]]:
  """A part's metrics rows on the run's count: waves, steps and global clock go on, times from the run's start."""
  return [dict(r, wave=r["wave"] + done, step=r["step"] + taken[r["vw"]], global_clock=r["global_clock"] + done,
               time=r["time"] + start) for r in rows]
