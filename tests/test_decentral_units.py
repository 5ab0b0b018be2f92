"""The decentralised run's clock and shard copies as units, without processes (docs/PROTOCOL.md section 11.5).

A :class:`FakeNode` stands for a process's node: what it sends to another process is recorded, what it sends
to itself goes through the context's mailbox as in a run. The tests drive :class:`ClockService` and
:class:`ShardFollower` by the messages they take (``have`` messages, order entries, update parts) and read
what they emit (the trace's ``push`` lines, order entries, served pulls, ``have`` messages): the
primary-backup guarantees of the protocol, each in a second, where the multi-process tests need minutes.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetpipe_jax.cluster import get_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.runtime.processes.clock import ClockService
from hetpipe_jax.runtime.processes.decentral import Context
from hetpipe_jax.runtime.processes.shards import ShardFollower
from hetpipe_jax.runtime.processes.stage_loop import control_width
from hetpipe_jax.runtime.transport import protocol
from hetpipe_jax.runtime.transport.mailbox import Mailbox, update_arrays

GPUS = get_cluster("hetero4").gpus


class FakeNode:
  """A process's node without a transport: every message to another process is kept in :attr:`sent`."""

  def __init__(self, process: int, num_processes: int):
    self.process, self.num_processes = process, num_processes
    self.device = jax.devices("cpu")[0]
    self.dead: set[int] = set()
    self.fatal: str | None = None
    self.recoverable = False
    self.sent: list[tuple[int, str, list[np.ndarray]]] = []  # (to process, tag, arrays)
    self.keys: dict[str, str] = {}

  def send_direct(self, dst: int, tag: str, arrays, stream: str, hold: int) -> None:
    del stream, hold
    self.sent.append((dst, tag, [np.asarray(a) for a in arrays]))

  def send(self, dst: int, tag: str, arrays) -> None:
    self.sent.append((dst, tag, [np.asarray(a) for a in arrays]))

  def put(self, key: str, value: str) -> None:
    self.keys[key] = value

  def scoped(self, name: str) -> str:  # (one part: names as they are)
    return name

  def publish_fatal(self, message: str) -> None:
    self.fatal = self.fatal or message


def context(process: int, num_processes: int, layout: Layout, owners: dict[tuple[int, int], int],
            shard_owners: list[int], waves: int = 4, d: int = 0) -> Context:
  """Process ``process``'s context; every process's primaries backed up by the next process."""
  return Context(node=cast(Any, FakeNode(process, num_processes)), mailbox=Mailbox(), layout=layout,
                 owners=owners, shard_owners=shard_owners,
                 backup_of=[(p + 1) % num_processes for p in range(num_processes)], clock=0, waves=waves, d=d,
                 schedule="1f1b", weight_mode="stash", unit_specs=[], streams=cast(Any, None), cost=None,
                 time_scale=0.0, trace=Trace())


def sent(ctx: Context) -> list[tuple[int, str, list[np.ndarray]]]:
  return cast(FakeNode, ctx.node).sent


# --- the clock ----------------------------------------------------------------------------------------------
# Three processes; unit 0's primary in process 1 (its backup in 2), unit 1's in process 2 (its backup in 0):
# every process holds a copy. VW 0: stage 0 (unit 0) in process 1, stage 1 (unit 1) in process 2. VW 1: one
# stage of both units in process 0.

CLOCK_LAYOUT = Layout((VWLayout(GPUS[1:3], (0, 1, 2), nm=1), VWLayout(GPUS[:1], (0, 2), nm=1)))
CLOCK_OWNERS = {(0, 0): 1, (0, 1): 2, (1, 0): 0}
HOLDS = {0: [1], 1: [0], 2: [0, 1]}  # process -> the units it holds a copy of


def clock_service() -> ClockService:
  return ClockService(context(0, 3, CLOCK_LAYOUT, CLOCK_OWNERS, [1, 2]), eval_every=100, on_nonfinite="skip")


def have(vw: int, process: int, wave: int, stage_skipped: dict[int, int] | None = None) -> tuple[str, int, list]:
  """Process ``process``'s ``have`` of ``vw``'s wave, as the clock's input stream offers it: per unit it holds,
  its stage's skipped count (``stage_skipped``: unit -> count), 0 for the units held elsewhere."""
  skipped = [(stage_skipped or {}).get(u, 0) if u in HOLDS[process] else 0 for u in range(2)]
  message = protocol.encode(protocol.CONTROL_OPS, "have", control_width(2), [0, 0, *skipped], wave=wave)
  return (f"h{vw}.{process}", wave, [message])


def counted(clock: ClockService) -> list[int]:
  """Every VW's waves the clock has counted."""
  return list(clock._clock.c_local)


def pushes(clock: ClockService) -> list[dict]:
  return [ev for ev in clock.ctx.trace.events if ev["ev"] == "push"]


def request(vw: int, n: int) -> tuple[str, int, list]:
  """Stage 0 of ``vw`` asks for pull ``n``, as the clock's input stream offers it."""
  return (f"r{vw}", n, [protocol.encode(protocol.CONTROL_OPS, "request", control_width(2), n=n)])


def orders(clock: ClockService, *ops: str) -> list[tuple]:
  """The entries of the order the clock sent process 2 whose operation is one of ``ops``: (op, fields, the
  snapshot of a serve: every VW's clock, then which had left)."""
  out = []
  for dst, tag, arrays in sent(clock.ctx):
    if dst == 2 and tag.startswith("o"):
      op, fields, tail = protocol.decode(protocol.ORDER_OPS, arrays[0])
      if op in ops:
        out.append((op, fields, tail[:4]) if op == "serve" else (op, fields))
  return out


def applies(clock: ClockService) -> list[dict]:
  return [fields for _, fields in orders(clock, "apply")]


def test_the_clock_counts_a_push_only_once_every_live_copy_holds_it():
  """A push in flight is applied everywhere or nowhere: the clock ticks when the last live copy says it holds
  the wave, not at the first (``ClockService._tick``)."""
  clock = clock_service()
  for p in (2, 1):
    assert clock._work([have(1, p, 0)])
    assert counted(clock) == [0, 0] and pushes(clock) == [] and applies(clock) == [], (
        f"VW 1's wave 0 counted when process {p} held it, before every live copy did")
  assert clock._work([have(1, 0, 0)])  # the last copy: now it counts
  assert counted(clock) == [0, 1]
  assert [(ev["vw"], ev["wave"]) for ev in pushes(clock)] == [(1, 0)]
  assert applies(clock) == [{"vw": 1, "wave": 0, "drop": 0}]


def test_a_lost_copy_no_longer_holds_back_a_push():
  """Once process 1 is lost (VW 0, with a stage there, leaves), the copies in processes 0 and 2 are every live
  copy: a wave they both hold counts, the one they held before the loss at once."""
  clock = clock_service()
  assert clock._work([have(1, 2, 0), have(1, 0, 0)])
  assert counted(clock) == [0, 0]  # process 1 (unit 0's primary) has not said so yet
  assert clock._work([("lost", 1, None)])
  assert clock.ctx.node.fatal is None
  assert [ev["vw"] for ev in clock.ctx.trace.events if ev["ev"] == "leave"] == [0]
  assert counted(clock)[1] == 1 and [(ev["vw"], ev["wave"]) for ev in pushes(clock)] == [(1, 0)]
  assert clock._work([have(1, 2, 1)]) and counted(clock)[1] == 1
  assert clock._work([have(1, 0, 1)]) and counted(clock)[1] == 2


def test_the_push_skipped_count_is_the_stages_not_the_sum_over_copies():
  """fp16: each copy reports, per unit it holds, the skipped count of that unit's stage; a unit has two copies,
  so the push's ``skipped`` is the stages' counts once each (2 + 1), not summed over the copies (6)."""
  clock = clock_service()
  counts = {0: 2, 1: 1}  # VW 0: stage 0 (unit 0) skipped 2 updates of the wave, stage 1 (unit 1) skipped 1
  assert clock._work([have(0, p, 0, counts) for p in (0, 1, 2)])
  assert [(ev["vw"], ev.get("skipped")) for ev in pushes(clock)] == [(0, 3)]
  assert clock._work([have(0, p, 1) for p in (0, 1, 2)])  # a clean wave: no skipped field
  assert [ev.get("skipped") for ev in pushes(clock)] == [3, None]


def test_the_clock_grants_a_pull_after_the_own_wave_and_once_the_gate_opens():
  """Pull n of a VW is served once its own wave n is counted and its gate is open (D = 0): VW 0 asks before its
  wave 0 is counted (no wait: it is not at the gate), VW 1 asks after its wave 0, ahead of VW 0 by one wave
  (the gate is closed: a ``wait`` line). VW 0's wave 0 then opens both, served in order with the snapshot."""
  clock = clock_service()
  assert clock._work([request(0, 0)] + [have(1, p, 0) for p in (0, 1, 2)] + [request(1, 0)])
  assert counted(clock) == [0, 1] and orders(clock, "serve") == []
  assert clock._work([have(0, p, 0) for p in (0, 1, 2)])
  assert orders(clock, "apply", "serve") == [
      ("apply", {"vw": 1, "wave": 0, "drop": 0}), ("apply", {"vw": 0, "wave": 0, "drop": 0}),
      ("serve", {"vw": 0, "n": 0}, [1, 1, 0, 0]), ("serve", {"vw": 1, "n": 0}, [1, 1, 0, 0])]
  assert [ev["vw"] for ev in clock.ctx.trace.events if ev["ev"] == "wait"] == [1]


# --- a copy of the shards -----------------------------------------------------------------------------------
# Two processes; unit 0's primary in process 0 (its backup in 1), unit 1's in process 1 (its backup in 0). One
# VW, one stage of both units in process 1. The copies tested are process 1's: unit 1's primary, unit 0's backup.

SHARD_LAYOUT = Layout((VWLayout(GPUS[:1], (0, 2), nm=1),))
PARAMS = [{"w": jnp.arange(3.0)}, {"w": jnp.full((2,), 10.0)}]
WIDTH = protocol.order_width(1)


def follower() -> ShardFollower:
  return ShardFollower(context(1, 2, SHARD_LAYOUT, {(0, 0): 1}, [0, 1]), PARAMS, optax.identity())


def order(shards: ShardFollower, op: str, tail=(), **fields: int) -> None:
  assert not shards._follow(protocol.encode(protocol.ORDER_OPS, op, WIDTH, tail, **fields))


def push_part(shards: ShardFollower, wave: int, update: list[Any], skipped: int = 0) -> None:
  """The stage's part of ``wave`` (both units) lands at the copy: the update, the flags, the skipped count."""
  shards._part(0, 0, wave, update_arrays(update, 0, [0, 1], set(), skipped, shards.ctx.node.device))


def served(shards: ShardFollower, n: int, primary: int) -> tuple[np.ndarray, list[int]]:
  """(the weights, the snapshot) of pull ``n`` of ``primary``'s unit that this process sent its stage."""
  w, glob = shards.ctx.mailbox.take(protocol.tag("served", vw=0, stage=0, n=n, primary=primary), 1.0)
  return np.asarray(w), np.asarray(glob).tolist()


def test_a_backup_resends_the_pull_it_kept_not_its_weights_now():
  """The backup of a live primary keeps what it would have served; when the order says the primary is lost,
  it sends that (the snapshot's weights), though it has applied a wave since (section 11.5)."""
  shards = follower()
  order(shards, "serve", [0, 0], vw=0, n=0)  # pull 0 at clock 0
  w1, glob = served(shards, 0, primary=1)
  assert np.array_equal(w1, [10.0, 10.0]) and glob == [0, 0]
  assert shards.ctx.mailbox._items == {}  # unit 0's primary is alive: the backup only keeps it
  push_part(shards, 0, [{"w": jnp.ones(3)}, {"w": jnp.ones(2)}])
  order(shards, "apply", vw=0, wave=0, drop=0)
  order(shards, "lost", process=0)
  w0, glob = served(shards, 0, primary=0)
  assert np.array_equal(w0, [0.0, 1.0, 2.0]) and glob == [0, 0], (
      f"the backup re-served pull 0 (clock {glob}) with weights {w0}; pull 0 held [0, 1, 2] (wave 0 came later)")
  order(shards, "serve", [1, 0], vw=0, n=1)  # from now on the backup serves unit 0: its weights now
  w0, glob = served(shards, 1, primary=0)
  assert np.array_equal(w0, [1.0, 2.0, 3.0]) and glob == [1, 0]
  assert np.array_equal(served(shards, 1, primary=1)[0], [11.0, 11.0])


def test_a_copy_tells_the_clock_each_units_stage_count():
  """The ``have`` a copy sends the clock: per unit, the flag and the skipped count of the unit's stage (here
  one stage holds both units: its count for each), the count the clock reads at each stage's first unit."""
  shards = follower()
  push_part(shards, 0, [{"w": jnp.ones(3)}, {"w": jnp.ones(2)}], skipped=2)
  [(dst, tag, [message])] = sent(shards.ctx)
  assert (dst, tag) == (0, protocol.tag("have", vw=0, process=1, wave=0))
  op, fields, tail = protocol.decode(protocol.CONTROL_OPS, message)
  assert (op, fields, tail) == ("have", {"wave": 0}, [0, 0, 2, 2])


def test_a_dropped_wave_counts_without_changing_the_weights_and_a_gather_says_so():
  """``apply`` with ``drop`` (a unit of the wave was not finite somewhere) only counts the wave; a gather sends
  process 0 every copy held here (unit order) and how many waves of each VW this process applied."""
  shards = follower()
  push_part(shards, 0, [{"w": jnp.ones(3)}, {"w": jnp.ones(2)}])
  order(shards, "apply", vw=0, wave=0, drop=1)
  push_part(shards, 1, [{"w": jnp.ones(3)}, {"w": jnp.ones(2)}])
  order(shards, "apply", vw=0, wave=1, drop=0)
  order(shards, "gather", n=0)
  [(dst, tag, arrays)] = [m for m in sent(shards.ctx) if m[1].startswith("w")]
  assert (dst, tag) == (0, protocol.tag("weights", process=1, n=0))
  assert [a.tolist() for a in arrays] == [[1.0, 2.0, 3.0], [11.0, 11.0], [2]]
