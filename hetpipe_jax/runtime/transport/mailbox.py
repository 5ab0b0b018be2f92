"""Arrays between the threads and processes of a ``multiprocess`` run (:mod:`hetpipe_jax.runtime.processes`):
a :class:`Mailbox` between the stages and shards of one process, :func:`deliver` and :func:`collect` that go
through it or through the transport (:mod:`hetpipe_jax.runtime.transport.node`), trees of a checkpoint's part
as arrays, and the timeouts that tell a lost process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hetpipe_jax.errors import RunStopped
from hetpipe_jax.runtime.numerics import checkpoint
from hetpipe_jax.runtime.transport.node import POLL_S, Node, PeerGone

TIMEOUT_S = 60.0  # a message or key that takes longer means a hung or lost process: the job ends
IDLE_S = 3600.0  # how long a thread may wait for a message from its own process (it does nothing else)

class Mailbox:
  """Tensors between stages of one process (the transport is for other processes). A taker waits on its
  key's own event: a put wakes only the thread that waits for it."""

  def __init__(self):
    self._items: dict[str, Any] = {}
    self._waiting: dict[str, threading.Event] = {}
    self._lock = threading.Lock()

  def put(self, key: str, value: Any) -> None:
    with self._lock:
      self._items[key] = value
      event = self._waiting.get(key)
    if event is not None:
      event.set()

  def take(self, key: str, timeout_s: float, node: Node | None = None) -> Any:
    """The value put under ``key``; with ``node``, gives up once the job cannot go on (process 0's verdict,
    :attr:`Node.fatal`: the thread that would put it may be waiting for a process that is gone) or, in a
    recoverable job, once it is stopping (both looked at every ``POLL_S`` of waiting).

    Raises:
      TimeoutError: after ``timeout_s``.
      RunStopped: when the job cannot go on.
      PeerGone: when the job is stopping.
    """
    with self._lock:
      if key in self._items:
        return self._items.pop(key)
      event = self._waiting.setdefault(key, threading.Event())
    deadline = time.monotonic() + timeout_s
    while not event.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
      if node is not None and node.fatal:
        raise RunStopped(node.fatal)
      if node is not None and node.recoverable and node.stopping():
        raise PeerGone(node.process, " (the job is stopping)")
      if time.monotonic() >= deadline:
        raise TimeoutError(f"no {key} within {timeout_s:g} s")
    with self._lock:
      del self._waiting[key]
      return self._items.pop(key)


def deliver(node: Node, mailbox: Mailbox, dst: int, tag: str, arrays: list[Any], stream: str | None = None,
            hold: int = 0) -> None:
  """Sends ``arrays`` to process ``dst`` under ``tag`` (through the mailbox when ``dst`` is this process); with
  ``stream``, without a notice (:meth:`Node.send_direct`: the receiver knows the shapes; the last ``hold``
  offers on ``stream`` stay alive)."""
  if dst == node.process:
    mailbox.put(tag, arrays)
  elif stream is not None:
    node.send_direct(dst, tag, arrays, stream, hold)
  else:
    node.send(dst, tag, arrays)


def collect(node: Node, mailbox: Mailbox, src: int, tag: str, specs: Sequence[tuple[Any, Any]] | None = None
            ) -> list[Any]:
  """The arrays process ``src`` delivered under ``tag``; ``specs`` ((shape, dtype) each) for what was sent
  without a notice."""
  if src == node.process:
    return mailbox.take(tag, TIMEOUT_S, node)
  if specs is not None:
    return node.recv_direct(src, tag, specs, TIMEOUT_S)
  return node.recv(src, tag, TIMEOUT_S)


def expect(node: Node, mailbox: Mailbox, src: int, tag: str, specs: Sequence[tuple[Any, Any]]
           ) -> Callable[[], list[Any]]:
  """Asks now for the arrays process ``src`` will deliver under ``tag`` without a notice; returns what waits
  for them (as long as it takes: a thread that does nothing else). Asking early takes the request's trip off
  the message's path (:meth:`Node.post_direct`)."""
  if src == node.process:
    return lambda: mailbox.take(tag, IDLE_S, node)
  arrays = node.post_direct(src, tag, specs)
  return lambda: node.wait_direct(src, tag, arrays)


def send_tree(node: Node, mailbox: Mailbox, dst: int, tag: str, tree: Any) -> None:
  """Sends any tree of plain values and arrays (a checkpoint's part) to process ``dst`` under ``tag``."""
  skeleton, arrays = checkpoint.split(tree)
  leaves = [np.frombuffer(skeleton, np.uint8)] + [arrays[str(i)] for i in range(len(arrays))]
  deliver(node, mailbox, dst, tag, [jax.device_put(x, node.device) for x in leaves])


def receive_tree(node: Node, mailbox: Mailbox, src: int, tag: str) -> Any:
  """The tree process ``src`` sent with :func:`send_tree` (its arrays as numpy)."""
  skeleton, *arrays = collect(node, mailbox, src, tag)
  return checkpoint.join(np.asarray(skeleton).tobytes(), {str(i): np.asarray(a) for i, a in enumerate(arrays)})


def unflatten_units(treedefs: Sequence[Any], leaves: Sequence[Any]) -> list[Any]:
  """Splits the leaves of several units, flattened one after another, back into one tree per unit."""
  out, leaves = [], list(leaves)
  for treedef in treedefs:
    out.append(jax.tree.unflatten(treedef, leaves[:treedef.num_leaves]))
    leaves = leaves[treedef.num_leaves:]
  return out


def update_arrays(update: Sequence[Any], first: int, units: Sequence[int], bad: set[int], skipped: int,
                  device: Any) -> list[Any]:
  """An ``update`` message (docs/PROTOCOL.md section 7): the summed updates of ``units`` (``update`` holds a
  stage's, from unit ``first``), flattened in unit order, then one int32 array: 1 for each of those units
  in ``bad`` (not finite), then the stage's count of the wave's updates fp16 skipped."""
  leaves = jax.tree.leaves(tuple(update[u - first] for u in units))
  tail = np.array([*(int(u in bad) for u in units), skipped], np.int32)
  return [*leaves, jax.device_put(tail, device)]
