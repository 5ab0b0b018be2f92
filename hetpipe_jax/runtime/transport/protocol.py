"""The multi-process protocol as data: every command a process executes and every kind of array message
between processes, written once and read by both ends (docs/PROTOCOL.md section 7).

* :data:`STAGE_OPS` and :data:`SHARD_OPS`: the commands of a stage's channel (``<vw>.<stage>``) and of a
  process's PS-shard channel (``ps<process>``), each with the fields it carries. The controller builds a
  command with :func:`command` and the executing thread dispatches it with :func:`dispatcher`: a misspelt
  operation or field fails at once, naming the table's choices, where it used to wait 60 s for a report
  that could not come.
* :data:`MESSAGES`: the array messages (activations, gradients, wave updates, pulls, checkpoint parts),
  each a tag template with its fields and who sends it to whom; both ends build the tag with :func:`tag`.
* :data:`COMMAND_KEY` and :data:`REPORT_KEY`: where a command and its report live in the coordination
  service's key-value store.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hetpipe_jax.errors import ProtocolError

COMMAND_KEY = "cmd/{channel}/{seq}"  # a command, posted by process 0
REPORT_KEY = "done/{channel}/{seq}"  # its report, posted by the process that executed it
STOP = "stop"  # the last command of every channel (no fields, always reported)


class Op(NamedTuple):
  """A command: its name, the fields it carries, what it does."""

  name: str
  fields: tuple[str, ...]
  doc: str


class Message(NamedTuple):
  """A kind of array message: its tag template (its fields in braces), who sends it and who receives it."""

  name: str
  template: str
  sender: str
  receiver: str

  @property
  def fields(self) -> tuple[str, ...]:
    return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)


def _table(items) -> dict[str, Any]:
  return {item.name: item for item in items}


STAGE_OPS: dict[str, Op] = _table([
    Op("fwd", ("mb",), "the forward of minibatch mb (stage 0 draws it; others receive its activation)"),
    Op("bwd", ("mb",), "the backward of minibatch mb (the last stage from its loss; others receive the gradient)"),
    Op("take", ("wave", "check"), "close the wave: send each unit's summed update to its shard's owner"),
    Op("rebase", ("n", "expect"), "pull n from the owners, add back the open accumulators (expect of them)"),
    Op("drop", (), "the virtual worker failed: forget what its forwards kept and its open accumulators"),
    Op("restart", ("n",), "a replacement: pull n's global weights, a fresh local optimizer"),
    Op("snapshot", ("n", "inbound"), "for a checkpoint: take the inputs sent but not used, send the state"),
    Op("restore", ("n",), "a resumed run: receive the state process 0 sends"),
    Op("die", (), "an injected crash: SIGKILL this process"),
    Op(STOP, (), "the channel's last command"),
])

SHARD_OPS: dict[str, Op] = _table([
    Op("apply", ("vw", "wave", "drop"), "apply (or, with drop, only count) the wave's updates from its stages"),
    Op("serve", ("vw", "stage", "n"), "send the stage its units' global weights as pull n"),
    Op("gather", ("n",), "send every shard's global weights to process 0 (evaluation)"),
    Op("sync", (), "nothing: reported once every earlier command is done"),
    Op("leave", ("vw",), "the virtual worker left"),
    Op("join", ("vw",), "the virtual worker (a replacement) joined"),
    Op("snapshot", ("n",), "for a checkpoint: send the shards' state to process 0"),
    Op("restore", ("n",), "a resumed run: receive the shards' state from process 0"),
    Op(STOP, (), "the channel's last command"),
])

MESSAGES: dict[str, Message] = _table([
    Message("activation", "a{vw}g{gen}.{stage}.{mb}", "stage - 1", "stage (of generation gen)"),
    Message("gradient", "g{vw}g{gen}.{stage}.{mb}", "stage + 1", "stage (of generation gen)"),
    Message("update", "u{vw}.{stage}.{wave}", "stage", "the owners of its units' shards"),  # (+ flags, skipped)
    Message("pull", "p{vw}.{stage}.{n}", "the owners of its units' shards", "stage"),
    Message("stage_state", "s{vw}.{stage}.{n}", "stage", "process 0 (a checkpoint)"),
    Message("stage_restore", "r{vw}.{stage}.{n}", "process 0", "stage (a resumed run)"),
    Message("shard_state", "S{process}.{n}", "a process's shards", "process 0 (a checkpoint)"),
    Message("shard_restore", "R{process}.{n}", "process 0", "a process's shards (a resumed run)"),
    Message("weights", "w{process}.{n}", "a process's shards", "process 0 (a gather)"),
    Message("control", "c{vw}.{seq}", "stage 0 (a decentralised run)", "the clock: a request or an injected failure"),
    Message("have", "h{vw}.{process}.{wave}", "a process's shards (a decentralised run)",
            "the clock: they hold the wave's update"),
    Message("order", "o{process}.{seq}", "the clock", "a process's shards (a decentralised run)"),
    Message("served", "q{vw}.{stage}.{n}.{primary}", "the live copy of primary's shards (a decentralised run)",
            "stage: pull n of the units whose primary is process primary, with the waves it holds"),
    Message("trace_part", "T{process}", "every process", "process 0 (a decentralised run's trace)"),
])

# A decentralised run (docs/PROTOCOL.md section 11.9): control messages are small int32 arrays that travel
# like activations (no key-value operation): [operation, fields..., padding]. Each process holding a copy of
# PS shards tells the clock (``have``) once it holds every part of a wave's update that it applies, with
# the non-finite flag of every unit; stage 0 of each virtual worker asks for the pull of a gated minibatch
# (``control``). The clock puts every apply, serve, gather and loss into one order (``order``) that every
# copy of the shards follows.
CONTROL_OPS: dict[str, Op] = _table([
    Op("have", ("wave",), "this process holds its parts of the wave's update (+ one non-finite flag per unit, "
                          "then each unit's stage's fp16 skipped count)"),
    Op("request", ("n",), "stage 0 may inject its n-th gated minibatch once the gate opens: pull n"),
    Op("fail", ("wave",), "stage 0 reached a fault injected at this wave (--fail): the virtual worker leaves"),
])

ORDER_OPS: dict[str, Op] = _table([
    Op("apply", ("vw", "wave", "drop"), "apply the wave's update (with drop: only count it)"),
    Op("serve", ("vw", "n"), "pull n: each stage gets its units' global weights from their live copy "
                             "(+ the waves the snapshot holds and the VWs that had left)"),
    Op("gather", ("n",), "send the global weights of every shard held here to process 0 (evaluation)"),
    Op("leave", ("vw",), "the virtual worker left: drop what it sent that was not applied"),
    Op("lost", ("process",), "the process is gone: its backups take over its primary shards"),
    Op(STOP, (), "the order's last entry"),
])


def order_width(num_vws: int) -> int:
  """Entries of an order: operation, three fields, then (a serve) the waves of every virtual worker its
  snapshot holds and which had left."""
  return 4 + 2 * num_vws


def encode(ops: Mapping[str, Op], op: str, width: int, tail: Sequence[int] = (), **fields: int) -> Any:
  """Control message ``op`` of the table ``ops`` as an int32 array of ``width``: its index in the table, its
  fields in the table's order, then ``tail`` (e.g. flags), zero-padded.

  Raises:
    ProtocolError: for an operation the table lacks, fields other than its own, or more than ``width``.
  """

  spec = ops.get(op)
  if spec is None:
    raise ProtocolError(f"unknown control message {op!r}; the table has {', '.join(ops)}")
  _check_fields(f"control message {op!r}", fields, spec.fields)
  values = [list(ops).index(op), *(int(fields[f]) for f in spec.fields), *(int(v) for v in tail)]
  if len(values) > width:
    raise ProtocolError(f"control message {op!r} needs {len(values)} entries; the message holds {width}")
  return np.array(values + [0] * (width - len(values)), np.int32)


def decode(ops: Mapping[str, Op], message: Any) -> tuple[str, dict[str, int], list[int]]:
  """(operation, fields, the rest) of a message :func:`encode` built."""
  values = [int(v) for v in message]
  spec = list(ops.values())[values[0]]
  n = len(spec.fields)
  return spec.name, dict(zip(spec.fields, values[1:1 + n])), values[1 + n:]


def _check_fields(what: str, given: Mapping[str, Any], fields: tuple[str, ...]) -> None:
  if set(given) != set(fields):
    raise ProtocolError(f"{what} takes fields {list(fields)}, got {sorted(given)}")


def tag(kind: str, **fields: Any) -> str:
  """The tag of a message of ``kind`` (a key of :data:`MESSAGES`) with these fields.

  Raises:
    ProtocolError: for an unknown kind, or fields other than the kind's.
  """
  message = MESSAGES.get(kind)
  if message is None:
    raise ProtocolError(f"unknown message kind {kind!r}; the protocol has {', '.join(MESSAGES)}")
  _check_fields(f"message {kind!r}", fields, message.fields)
  return message.template.format(**fields)


def command(ops: Mapping[str, Op], op: str, report: bool = True, **fields: Any) -> str:
  """The JSON of command ``op`` of the table ``ops`` with its fields (``report``: whether its executor
  reports it).

  Raises:
    ProtocolError: for an operation the table lacks, or fields other than the operation's.
  """
  spec = ops.get(op)
  if spec is None:
    raise ProtocolError(f"unknown command {op!r}; the channel takes {', '.join(ops)}")
  _check_fields(f"command {op!r}", fields, spec.fields)
  return json.dumps({"op": op, **fields, "report": report})


def dispatcher(ops: Mapping[str, Op], handlers: Mapping[str, Callable[[dict], Any]]) -> Callable[[dict], Any]:
  """``handle(cmd)`` for an executing thread: the handler of the command's operation. Every operation of
  the table but :data:`STOP` (which ends the channel) must have one, and no other.

  Raises:
    ProtocolError: when ``handlers`` and the table differ (at construction, before any command).
  """
  expected = set(ops) - {STOP}
  if set(handlers) != expected:
    raise ProtocolError(f"handlers for {sorted(handlers)}; the table has {sorted(expected)}")
  return lambda cmd: handlers[cmd["op"]](cmd)
