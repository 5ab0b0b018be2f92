"""Command channels of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`): process 0 posts a
channel's commands (:class:`Channel`, built and checked by :mod:`hetpipe_jax.runtime.transport.protocol`) in the
coordination service's key-value store; the thread that owns the channel executes them in the order posted
(:func:`command_loop`) and reports those that ask; :func:`wait` reads a report. :class:`Wiring` says where
everything of the job runs, as every thread of a process sees it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from hetpipe_jax.errors import ProtocolError, RunStopped, TaskFailed
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import IDLE_S, TIMEOUT_S, JobStopped, Mailbox
from hetpipe_jax.runtime.transport.node import POLL_S, Node, PeerGone


class Wiring(NamedTuple):
  """How this process's threads reach the job: its node, where every stage and PS shard runs, and the
  mailbox of tensors between its threads.

  Attributes:
    node: this process's node.
    owners: (virtual worker, stage) -> the process that runs it, for every stage of the job.
    shard_owners: the process of every unit's PS shard.
    mailbox: tensors between this process's threads.
  """

  node: Node
  owners: dict[tuple[int, int], int]
  shard_owners: Sequence[int]
  mailbox: Mailbox


def command_loop(node: Node, channel: str, handle, what: str) -> None:
  """Executes the commands of ``channel`` (:data:`~hetpipe_jax.runtime.transport.protocol.COMMAND_KEY`) in order with
  ``handle(cmd) -> reply`` (:func:`~hetpipe_jax.runtime.transport.protocol.dispatcher`) until a stop command,
  reporting (:data:`~hetpipe_jax.runtime.transport.protocol.REPORT_KEY`) the commands that ask for a report.

  A command that waited for a process that is gone (:class:`PeerGone`, outside a task) or found why the
  job must stop (:class:`JobStopped`) leaves this channel unable to go on: it tells process 0 why (which
  stops the job in one line) and ends the channel. Any other failure ends this process at once (the
  others follow, or go on without it)."""
  seq, cmd = 0, {}
  try:
    while True:
      cmd = json.loads(node.get(protocol.COMMAND_KEY.format(channel=channel, seq=seq), IDLE_S))
      if cmd["op"] == protocol.STOP:
        return
      reply = handle(cmd)
      if cmd.get("report", True):
        node.put(protocol.REPORT_KEY.format(channel=channel, seq=seq), json.dumps(reply))
      seq += 1
  except JobStopped as e:
    node.publish_fatal(str(e))
  except PeerGone as e:
    node.publish_fatal(f"{e}, so {what} (process {node.process}) could not finish its {cmd.get('op')} command "
                       f"{json.dumps(cmd)}: the job cannot go on consistently; resume from the newest checkpoint "
                       "(--resume)")
  except BaseException as e:  # pylint: disable=broad-except
    node.abort(f"{what}: {type(e).__name__}: {e}")


class Channel:
  """The controller's end of one command channel: posts commands, which its process executes in the order
  posted; a command posted with ``report=False`` is not reported (its effects are ordered by the channel:
  a failure ends its process, and with it the job).

  Args:
    node: process 0's node.
    name: the channel (``<vw>.<stage>`` or ``ps<process>``).
    process: the process that executes its commands.
    what: what executes them, for error messages (e.g. "VW 0 stage 1").
    ops: its commands (:data:`~hetpipe_jax.runtime.transport.protocol.STAGE_OPS` or ``SHARD_OPS``).
  """

  def __init__(self, node: Node, name: str, process: int, what: str, ops: Mapping[str, protocol.Op]):
    self.node, self.name, self.process, self.what, self.ops, self._seq = node, name, process, what, ops, 0

  def post(self, op: str, report: bool = True, **fields) -> Pending:
    """Posts command ``op`` with its fields; returns its pending report (for :func:`wait`).

    Raises:
      ProtocolError: for an operation or fields the channel's table does not have (nothing is posted).
    """
    text = protocol.command(self.ops, op, report, **fields)
    seq = self._seq
    self._seq += 1
    self.node.put(protocol.COMMAND_KEY.format(channel=self.name, seq=seq), text)
    return Pending(self, protocol.REPORT_KEY.format(channel=self.name, seq=seq))


@dataclasses.dataclass
class Pending:
  """A posted command's report to come; ``then(report)`` runs when :func:`wait` gets it."""

  channel: Channel
  key: str
  then: Callable[[dict], None] | None = None


def wait(pending: Pending) -> dict:
  """The report of a posted command (blocks until its process posts it).

  Raises:
    ProtocolError: naming the process, when no report comes within the timeout (it hung or is gone).
    TaskFailed: when the command raised in its process, or its process is gone (a task: its virtual
      worker fails).
    RunStopped: when the job cannot go on (:attr:`Node.fatal`: e.g. a process gone with PS shards).
  """
  channel = pending.channel
  node = channel.node
  deadline = time.monotonic() + TIMEOUT_S
  while True:
    if node.fatal:
      raise RunStopped(node.fatal)
    if channel.process in node.dead:
      raise TaskFailed(f"{channel.what}: process {channel.process} is gone", final=True)
    try:
      report = json.loads(node.get(pending.key, POLL_S if node.recoverable else TIMEOUT_S))
      break
    except TimeoutError:
      if time.monotonic() >= deadline:
        raise ProtocolError(f"no report from process {channel.process} ({channel.what}, {pending.key!r}) "
                            f"within {TIMEOUT_S:g} s: that process hung or is gone") from None
  if pending.then is not None:
    pending.then(report)
  if "error" in report:
    raise TaskFailed(f"{channel.what} (process {channel.process}): {report['error']}", report.get("final", False))
  return report
