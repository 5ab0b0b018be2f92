"""The multi-process protocol as data: every kind of array message between processes and every control message,
written once and read by both ends (docs/PROTOCOL.md section 7).

* :data:`MESSAGES`: the array messages (activations, gradients, wave updates, served pulls, gathers, control
  messages, trace parts), each a tag template with its fields and who sends it to whom; both ends build the tag
  with :func:`tag`: a misspelt kind or field fails at once, naming the table's choices.
* :data:`CONTROL_OPS` and :data:`ORDER_OPS`: the operations of a decentralised run's control messages (to the
  clock) and of its order (from the clock), each with the fields it carries; :func:`encode` builds one as a small
  int32 array and :func:`decode` reads it back.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hetpipe_jax.errors import ProtocolError

STOP = "stop"  # the last entry of an order (no fields)


class Op(NamedTuple):
  """An operation of a control message: its name, the fields it carries, what it does."""

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


MESSAGES: dict[str, Message] = _table([
    Message("activation", "a{vw}g{gen}.{stage}.{mb}", "stage - 1", "stage (of generation gen)"),
    Message("gradient", "g{vw}g{gen}.{stage}.{mb}", "stage + 1", "stage (of generation gen)"),
    Message("update", "u{vw}.{stage}.{wave}", "stage", "every copy of its units' shards"),  # (+ flags, skipped)
    Message("weights", "w{process}.{n}", "a process's shards", "process 0 (a gather)"),
    Message("control", "c{vw}.{seq}", "stage 0", "the clock: a request or an injected failure"),
    Message("have", "h{vw}.{process}.{wave}", "a process's shards", "the clock: they hold the wave's update"),
    Message("order", "o{process}.{seq}", "the clock", "a process's shards"),
    Message("served", "q{vw}.{stage}.{n}.{primary}", "the live copy of primary's shards",
            "stage: pull n of the units whose primary is process primary, with the waves it holds"),
    Message("trace_part", "T{process}", "every process", "process 0 (the run's trace)"),
])

# A decentralised run (docs/PROTOCOL.md section 11.5): control messages are small int32 arrays that travel
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
