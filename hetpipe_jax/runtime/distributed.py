"""Processes of a multi-process run: they meet through ``jax.distributed``, control messages go through its
coordination service (key-value store, barriers), arrays move through ``jax.experimental.transfer``.

This is the one module that touches JAX's experimental and private distributed APIs (tested with JAX
0.10.x, the range ``pyproject.toml`` allows); everything else uses :class:`Node`.

* :func:`join` calls ``jax.distributed.initialize`` (before any other JAX use: the first backend use
  waits for every process) and starts this process's transfer server, whose address it publishes
  under ``xfer/addr/<process>``.
* A message is an *offer* and a *notice*: :meth:`Node.send` offers the arrays on the transfer server
  under a fresh id (``await_pull`` does not block) and posts a JSON notice with that id and the arrays'
  shapes and dtypes under the predictable key ``msg/<src>-><dst>/<tag>/<seq>``; :meth:`Node.recv` waits
  for that key (a timeout here is how a dead sender shows), pulls, and deletes it. An offer can be pulled
  exactly once; the sender keeps the offered arrays alive until the receiver acknowledges by deleting the
  notice (checked once more than a few messages or MB are held), because deleting or donating an offered
  buffer before its pull breaks the pull.

Measured on this 2-core machine (BUILD_NOTES.md, "Multi-process transport"): 0.70-0.75 GB/s for 1-100 MB
pulls on loopback (a local ``device_put`` between two CPU devices: 1.5-1.7 GB/s), ~0.19 ms to pull a tiny
array that is already offered, ~0.4 ms per key-value operation.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.runtime.launch import die_with_launcher, record_reason

_ADDRESS_KEY = "xfer/addr/{process}"
_MESSAGE_KEY = "msg/{src}->{dst}/{tag}/{seq}"
_HOLD_MESSAGES, _HOLD_BYTES = 16, 64 << 20  # offered arrays held before checking which were pulled


def _client():
  """The coordination-service client of this process (no public accessor in JAX 0.10)."""
  from jax._src import distributed  # private: the only way to the key-value store in JAX 0.10

  client = distributed.global_state.client
  if client is None:
    raise ConfigError("jax.distributed is not initialized in this process; call hetpipe_jax's join() first")
  return client


class Node:
  """This process's view of a multi-process job: its key-value store and its transfer server.

  Args:
    process: this process's index.
    num_processes: how many processes the job has.
    device: the local device that received arrays are placed on (the process's CPU device).
  """

  def __init__(self, process: int, num_processes: int, device: Any):
    from jax.experimental import transfer  # experimental: wrapped here only

    self.process, self.num_processes, self.device = process, num_processes, device
    self._kv = _client()
    # transport_addresses must be given: with none, pulls work only inside one process.
    self._server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    self._kv.key_value_set(_ADDRESS_KEY.format(process=process), self._server.address())
    self._connections: dict[int, Any] = {}
    self._ids = itertools.count(1)
    self._sent: dict[tuple[int, str], int] = {}
    self._received: dict[tuple[int, str], int] = {}
    self._offered: dict[str, list[Any]] = {}  # notice key -> arrays kept alive until acknowledged
    self._lock = threading.Lock()  # several threads send and receive

  # --- control: the key-value store --------------------------------------------------------------------

  def put(self, key: str, value: str) -> None:
    """Sets ``key`` (once: keys are never overwritten)."""
    self._kv.key_value_set(key, value)

  def get(self, key: str, timeout_s: float) -> str:
    """Waits up to ``timeout_s`` for ``key``.

    Raises:
      TimeoutError: when the key does not appear in time (its writer is late, hung or gone).
    """
    try:
      return self._kv.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # the client raises a bare XlaRuntimeError with DEADLINE_EXCEEDED
      if "DEADLINE_EXCEEDED" in str(e):
        raise TimeoutError(f"process {self.process} waited {timeout_s:g} s for {key!r}") from None
      raise

  def delete(self, key: str) -> None:
    self._kv.key_value_delete(key)

  def barrier(self, name: str, timeout_s: float) -> None:
    """Waits until every process reaches the barrier ``name``."""
    self._kv.wait_at_barrier(name, int(timeout_s * 1000))

  # --- data: the transfer server -----------------------------------------------------------------------

  def _connection(self, peer: int, timeout_s: float):
    if peer not in self._connections:
      address = self.get(_ADDRESS_KEY.format(process=peer), timeout_s)
      self._connections[peer] = self._server.connect(address)
    return self._connections[peer]

  def send(self, dst: int, tag: str, arrays: Sequence[jax.Array]) -> None:
    """Offers ``arrays`` to process ``dst`` as the next message on channel ``tag``; does not block."""
    arrays = list(arrays)
    with self._lock:
      seq = self._sent.get((dst, tag), 0)
      self._sent[(dst, tag)] = seq + 1
      uid = next(self._ids)
      key = _MESSAGE_KEY.format(src=self.process, dst=dst, tag=tag, seq=seq)
      self._offered[key] = arrays
    self._server.await_pull(uid, arrays)
    self.put(key, json.dumps({"id": uid, "arrays": [[list(a.shape), str(a.dtype)] for a in arrays]}))
    with self._lock:  # checking every offer costs a key-value operation each: only when many are held
      held = sum(a.nbytes for arrays_ in self._offered.values() for a in arrays_)
      check = len(self._offered) > _HOLD_MESSAGES or held > _HOLD_BYTES
    if check:
      self._release_acknowledged()

  def recv(self, src: int, tag: str, timeout_s: float) -> list[jax.Array]:
    """The next message from process ``src`` on channel ``tag``, pulled onto this process's device.

    Raises:
      TimeoutError: when no message arrives within ``timeout_s``.
    """
    with self._lock:
      seq = self._received.get((src, tag), 0)
      self._received[(src, tag)] = seq + 1
    key = _MESSAGE_KEY.format(src=src, dst=self.process, tag=tag, seq=seq)
    notice = json.loads(self.get(key, timeout_s))
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
             for shape, dtype in notice["arrays"]]
    arrays = self._connection(src, timeout_s).pull(notice["id"], specs)
    jax.block_until_ready(arrays)
    self.delete(key)  # the acknowledgement: the sender may drop the arrays
    return list(arrays)

  def _release_acknowledged(self) -> None:
    """Drops the offered arrays whose notice the receiver has deleted (it pulled them)."""
    with self._lock:
      keys = list(self._offered)
    for key in keys:
      try:
        self._kv.key_value_try_get(key)
        continue  # the notice is still there: not pulled yet
      except Exception:  # NOT_FOUND: pulled
        pass
      with self._lock:
        self._offered.pop(key, None)

  def connect_all(self, timeout_s: float = 60.0) -> None:
    """Opens the transfer connections to every other process and moves one tiny message each way, so the
    first real message does not pay for connecting (call it in every process, before the clock starts)."""
    peers = [p for p in range(self.num_processes) if p != self.process]
    for peer in peers:
      self.send(peer, "hello", [jnp.zeros((1,), jnp.float32)])
    for peer in peers:
      self.recv(peer, "hello", timeout_s)

  def abort(self, message: str, code: int = 1) -> NoReturn:
    """Ends this process at once after a failure: prints ``message``, records it for the others under
    ``failed/<process>``, and exits with ``code`` without JAX's shutdown barrier (which would wait for
    every other process). The others learn of it through the heartbeat within its timeout."""
    print(f"error: process {self.process}: {message}", file=sys.stderr, flush=True)
    record_reason(message)
    try:
      self._kv.key_value_set(f"failed/{self.process}", message)
    finally:
      os._exit(code)

  def close(self, timeout_s: float = 60.0) -> None:
    """Waits (up to ``timeout_s``) until every process is done, so no pull is left pending at exit."""
    self.barrier("hetpipe_jax/close", timeout_s)
    self._offered.clear()


_CURRENT: list[Node] = []  # the Node of this process, once it has joined


def current_node() -> Node | None:
  """This process's :class:`Node` if it joined a job, else None."""
  return _CURRENT[0] if _CURRENT else None


def join(coordinator: str, num_processes: int, process: int, local_devices: int,
         heartbeat_timeout_s: int = 10, init_timeout_s: int = 60) -> Node:
  """Joins the job as process ``process`` of ``num_processes`` with ``local_devices`` CPU devices.

  Must run before anything else uses JAX in this process.

  Args:
    coordinator: ``HOST:PORT`` of the coordination service (process 0 hosts it).
    num_processes: processes in the job.
    process: this process's index, 0 .. num_processes - 1.
    local_devices: CPU devices this process holds (the GPUs of its node, emulated).
    heartbeat_timeout_s: a process silent this long counts as dead (JAX's default is 100 s).
    init_timeout_s: how long to wait for every process to arrive.

  Raises:
    ConfigError: for a process index out of range.
  """
  die_with_launcher()
  if not 0 <= process < num_processes:
    raise ConfigError(f"process_id={process} is outside 0..{num_processes - 1}; give each of the "
                      f"{num_processes} processes a distinct id in that range")
  jax.config.update("jax_num_cpu_devices", local_devices)
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             initialization_timeout=init_timeout_s)
  _CURRENT[:] = [Node(process, num_processes, jax.local_devices()[0])]
  return _CURRENT[0]
