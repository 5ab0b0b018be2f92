"""The multi-process protocol written once (hetpipe_jax/runtime/transport/protocol.py): docs/PROTOCOL.md's tables of
commands and message tags are the code's, a misspelt operation, field or tag fails where it is built (not as
a 60 s wait for a report), and an executing thread's handlers must cover its table exactly."""

import json
import os
import re

import pytest

from hetpipe_jax.errors import ProtocolError
from hetpipe_jax.runtime.processes.channels import Channel
from hetpipe_jax.runtime.transport import protocol

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "PROTOCOL.md")


def _section(title: str) -> list[list[str]]:
  with open(DOC, encoding="utf-8") as f:
    text = f.read()
  body = text[text.index(title):]
  body = body[:body.index("\n### ", 1)]
  rows = [line for line in body.splitlines() if line.startswith("|") and not line.startswith("| ---")]
  return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # (the header dropped)


def _names(cell: str) -> list[str]:
  return re.findall(r"`([^`]+)`", cell)


def test_the_documented_commands_are_the_tables():
  documented: dict[str, dict[str, tuple[str, ...]]] = {"stage": {}, "shard": {}}
  kind = None
  for channel, ops, fields, *_ in _section("### 11.4 Command channels"):
    if channel:
      kind = {"`<vw>.<j>`": "stage", "`ps<p>`": "shard", "every channel": "every"}[channel]
    for op in _names(ops):
      for k in (("stage", "shard") if kind == "every" else (kind,)):
        documented[k][op] = tuple(_names(fields))
  for k, table in (("stage", protocol.STAGE_OPS), ("shard", protocol.SHARD_OPS)):
    assert documented[k] == {name: op.fields for name, op in table.items()}, k


def test_the_documented_tags_are_the_messages():
  documented = {_names(kind)[0]: _names(tag)[0] for kind, tag, *_ in _section("### 11.5 Tensor message tags")}
  assert documented == {name: m.template for name, m in protocol.MESSAGES.items()}


def test_a_tag_is_built_from_its_fields_and_nothing_else():
  assert protocol.tag("activation", vw=1, gen=0, stage=2, mb=7) == "a1g0.2.7"
  assert protocol.tag("update", vw=0, stage=1, wave=3) == "u0.1.3"
  with pytest.raises(ProtocolError, match=r"message 'pull' takes fields \['vw', 'stage', 'n'\], got \['n', 'vw'\]"):
    protocol.tag("pull", vw=0, n=1)
  with pytest.raises(ProtocolError, match="unknown message kind 'updates'; the protocol has activation, gradient"):
    protocol.tag("updates", vw=0, stage=1, wave=3)


class _Store:
  """A key-value store that records what is set (a Node's put and nothing else)."""

  def __init__(self):
    self.items = {}

  def put(self, key, value):
    self.items[key] = value


def test_a_channel_refuses_a_misspelt_command_before_posting_it():
  store = _Store()
  channel = Channel(store, "0.1", 1, "VW 0 stage 1", protocol.STAGE_OPS)  # type: ignore[arg-type]
  pending = channel.post("rebase", report=False, n=2, expect=1)
  assert pending.key == "done/0.1/0" and json.loads(store.items["cmd/0.1/0"]) == {
      "op": "rebase", "n": 2, "expect": 1, "report": False}
  with pytest.raises(ProtocolError, match="unknown command 'rebse'; the channel takes fwd, bwd, take, rebase"):
    channel.post("rebse", n=3, expect=0)
  with pytest.raises(ProtocolError, match=r"command 'take' takes fields \['wave', 'check'\], got \['wave'\]"):
    channel.post("take", wave=0)
  with pytest.raises(ProtocolError, match="unknown command 'apply'"):  # a shard's command on a stage's channel
    channel.post("apply", vw=0, wave=0, drop=[])
  assert list(store.items) == ["cmd/0.1/0"]  # nothing else was posted, and the next command is seq 1
  channel.post("drop")
  assert "cmd/0.1/1" in store.items


def test_a_thread_handles_its_table_exactly():
  handlers = {name: (lambda c, name=name: name) for name in protocol.SHARD_OPS if name != protocol.STOP}
  dispatch = protocol.dispatcher(protocol.SHARD_OPS, handlers)
  assert dispatch({"op": "serve", "vw": 0, "stage": 1, "n": 2}) == "serve"
  with pytest.raises(ProtocolError, match=r"the table has \[.*'sync'"):
    protocol.dispatcher(protocol.SHARD_OPS, {k: v for k, v in handlers.items() if k != "sync"})
  with pytest.raises(ProtocolError, match="handlers for"):
    protocol.dispatcher(protocol.STAGE_OPS, handlers)


def test_the_documented_control_messages_are_the_tables():
  documented: dict[str, dict[str, tuple[str, ...]]] = {}
  stream = None
  for name, op, fields, *_ in _section("### 11.9 A decentralised run"):
    stream = _names(name)[0] if name else stream
    documented.setdefault(stream, {})[_names(op)[0]] = tuple(_names(fields))
  assert documented == {"control": {n: o.fields for n, o in protocol.CONTROL_OPS.items()},
                        "order": {n: o.fields for n, o in protocol.ORDER_OPS.items()}}


def test_a_control_message_is_built_from_its_table_and_read_back():
  message = protocol.encode(protocol.CONTROL_OPS, "have", 6, [0, 1, 0], wave=3)
  assert message.tolist() == [0, 3, 0, 1, 0, 0] and str(message.dtype) == "int32"
  assert protocol.decode(protocol.CONTROL_OPS, message) == ("have", {"wave": 3}, [0, 1, 0, 0])
  width = protocol.order_width(2)  # a serve carries the snapshot: 2 clocks, 2 left flags
  order = protocol.encode(protocol.ORDER_OPS, "serve", width, [4, 3, 0, 1], vw=1, n=2)
  assert protocol.decode(protocol.ORDER_OPS, order) == ("serve", {"vw": 1, "n": 2}, [4, 3, 0, 1, 0])
  lost = protocol.encode(protocol.ORDER_OPS, "lost", width, process=3)
  assert protocol.decode(protocol.ORDER_OPS, lost)[:2] == ("lost", {"process": 3})
  with pytest.raises(ProtocolError, match="unknown control message 'pull'; the table has have, request, fail"):
    protocol.encode(protocol.CONTROL_OPS, "pull", 4, n=1)
  with pytest.raises(ProtocolError, match=r"control message 'serve' takes fields \['vw', 'n'\], got \['n'\]"):
    protocol.encode(protocol.ORDER_OPS, "serve", width, n=1)
  with pytest.raises(ProtocolError, match="control message 'have' needs 5 entries; the message holds 4"):
    protocol.encode(protocol.CONTROL_OPS, "have", 4, [1, 1, 1], wave=0)
