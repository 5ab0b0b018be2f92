"""The multi-process protocol written once (hetpipe_jax/runtime/transport/protocol.py): docs/PROTOCOL.md's tables of
message tags and control messages are the code's, and a misspelt operation, field or tag fails where it is built
(not as a wait for a message that cannot come)."""

import os
import re

import pytest

from hetpipe_jax.errors import ProtocolError
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


def test_the_documented_tags_are_the_messages():
  documented = {_names(kind)[0]: _names(tag)[0] for kind, tag, *_ in _section("### 11.4 Tensor message tags")}
  assert documented == {name: m.template for name, m in protocol.MESSAGES.items()}


def test_a_tag_is_built_from_its_fields_and_nothing_else():
  assert protocol.tag("activation", vw=1, gen=0, stage=2, mb=7) == "a1g0.2.7"
  assert protocol.tag("update", vw=0, stage=1, wave=3) == "u0.1.3"
  with pytest.raises(ProtocolError, match=r"message 'served' takes fields \['vw', 'stage', 'n', 'primary'\], "
                                          r"got \['n', 'vw'\]"):
    protocol.tag("served", vw=0, n=1)
  with pytest.raises(ProtocolError, match="unknown message kind 'updates'; the protocol has activation, gradient"):
    protocol.tag("updates", vw=0, stage=1, wave=3)


def test_the_documented_control_messages_are_the_tables():
  documented: dict[str, dict[str, tuple[str, ...]]] = {}
  stream = None
  for name, op, fields, *_ in _section("### 11.5 A decentralised run"):
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
