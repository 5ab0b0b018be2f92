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
* A *direct* message has no notice: :meth:`Node.send_direct` offers the arrays under an id both ends derive
  from (sender, receiver, tag: a hash), and :meth:`Node.recv_direct`, which knows the arrays' shapes and
  dtypes, pulls it; a pull may come before its offer (the transfer server pairs them). No key-value
  operation: what stages send each other on every task. The sender holds its newest offers per stream, as
  many as the caller says can be in flight. :meth:`Node.post_direct` asks for a direct message ahead, without
  waiting (a pull returns at once; its arrays are ready when the data lands), and :meth:`Node.wait_direct`
  waits for it: a decentralised run's input streams.

Measured on this 2-core machine (BUILD_NOTES.md, "Multi-process transport"): 0.70-0.75 GB/s for 1-100 MB
pulls on loopback (a local ``device_put`` between two CPU devices: 1.5-1.7 GB/s), ~0.19 ms to pull a tiny
array that is already offered, ~0.4 ms per key-value operation.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.runtime.transport.launch import die_with_launcher, record_reason

_ADDRESS_KEY = "xfer/addr/{process}"
_MESSAGE_KEY = "msg/{src}->{dst}/{tag}/{seq}"
_HOLD_MESSAGES, _HOLD_BYTES = 16, 64 << 20  # offered arrays held before checking which were pulled
_ALIVE_KEY, _DEAD_KEY, _CLOSED_KEY = "alive/{process}", "dead/{process}", "closed/{process}"
_FATAL_KEY, _STOPPING_KEY, _BYE_KEY, _FAILED_KEY = "fatal", "stopping", "bye/{process}", "failed/{process}"
BEAT_S = 0.5  # a recoverable job's processes beat this often
DEAD_AFTER_S = 5.0  # a process whose beat has not moved for this long is gone (dead, hung or cut off)
POLL_S = 0.5  # how often a wait checks whether its peer is gone


class _DaemonPool:
  """Threads that run pulls and never hold up the process's exit (a pull given up on, from a process that is
  gone or never offered, blocks its thread for good; ``concurrent.futures``' pools join theirs at exit). They
  start with the first pull, so that importing this module starts nothing."""

  def __init__(self, size: int):
    self._work: queue.SimpleQueue = queue.SimpleQueue()
    self._size, self._started, self._lock = size, False, threading.Lock()

  def _start(self) -> None:
    with self._lock:
      if not self._started:
        for k in range(self._size):
          threading.Thread(target=self._loop, name=f"pull-{k}", daemon=True).start()
        self._started = True

  def _loop(self) -> None:
    while True:
      future, fn = self._work.get()
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn())
        except BaseException as e:  # pylint: disable=broad-except  # handed to the waiter
          future.set_exception(e)

  def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
    if not self._started:
      self._start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._work.put((future, fn))
    return future


_PULLS = _DaemonPool(16)  # pulls waited on with a deadline or a watch on the sender


class PeerGone(RuntimeError):
  """The process this one waits for is gone (declared dead by process 0, or its connection closed)."""

  def __init__(self, process: int, what: str = ""):
    super().__init__(f"process {process} is gone{what}")
    self.process = process


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
    self._direct: dict[tuple[int, str], collections.deque] = {}  # (dst, stream) -> the newest direct offers
    self._lock = threading.Lock()  # several threads send and receive
    self.recoverable, self._beating = False, False  # see :meth:`beat`
    self.dead: set[int] = set()  # process 0's verdicts (see :meth:`watch`)
    self.fatal: str | None = None  # why the job cannot go on (process 0, see :meth:`watch`)
    self.scope = ""  # prefixes every message tag and scoped key: a run of several parts (one layout after another)

  def scoped(self, name: str) -> str:
    """``name`` in the current part of the job (:attr:`scope`: messages, keys and barriers of one part never
    meet those of another)."""
    return self.scope + name

  # --- control: the key-value store --------------------------------------------------------------------

  def put(self, key: str, value: str) -> None:
    """Sets ``key`` (once: keys are never overwritten)."""
    self._kv.key_value_set(key, value)

  def try_get(self, key: str) -> str | None:
    """The value of ``key``, or None if it is not set."""
    try:
      return self._kv.key_value_try_get(key)
    except Exception:  # NOT_FOUND  # pylint: disable=broad-except
      return None

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

  def meet(self, name: str, timeout_s: float) -> None:
    """:meth:`barrier`; in a recoverable job a wait for every other process's key ``name/<process>`` instead,
    given up (:class:`PeerGone`) once one is declared gone (a barrier would wait for it to the timeout)."""
    if not self.recoverable:
      self.barrier(name, timeout_s)
      return
    self.put(f"{name}/{self.process}", "1")
    for p in range(self.num_processes):
      if p != self.process:
        self._get_from(p, f"{name}/{p}", timeout_s)

  # --- data: the transfer server -----------------------------------------------------------------------

  def _connection(self, peer: int, timeout_s: float):
    if peer not in self._connections:
      address = self.get(_ADDRESS_KEY.format(process=peer), timeout_s)
      self._connections[peer] = self._server.connect(address)
    return self._connections[peer]

  def send(self, dst: int, tag: str, arrays: Sequence[jax.Array]) -> None:
    """Offers ``arrays`` to process ``dst`` as the next message on channel ``tag``; does not block."""
    arrays, tag = list(arrays), self.scoped(tag)
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

  def send_direct(self, dst: int, tag: str, arrays: Sequence[jax.Array], stream: str, hold: int) -> None:
    """Offers ``arrays`` to process ``dst`` as the one message ``tag`` (unique in the job), under an id both
    ends derive from (this process, ``dst``, ``tag``): no notice, no key-value operation. The receiver must
    know the arrays' shapes and dtypes (:meth:`recv_direct`). The offers stay alive until ``hold`` newer ones
    went to ``dst`` on ``stream``: the caller's guarantee that by then the receiver has pulled them (e.g. a
    stage's activations: the Nm window lets at most Nm of them be in flight)."""
    arrays = list(arrays)
    self._server.await_pull(_direct_id(self.process, dst, self.scoped(tag)), arrays)
    with self._lock:
      held = self._direct.setdefault((dst, stream), collections.deque(maxlen=hold))
      held.append(arrays)

  def recv_direct(self, src: int, tag: str, specs: Sequence[tuple[tuple[int, ...], Any]],
                  timeout_s: float) -> list[jax.Array]:
    """Message ``tag`` from process ``src`` (:meth:`send_direct`), arrays of ``specs`` ((shape, dtype)
    each), pulled onto this process's device; the pull waits for the offer.

    Raises:
      TimeoutError: when it does not arrive within ``timeout_s``.
      PeerGone: when ``src`` is declared gone first (a recoverable job).
    """
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    shapes = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding) for shape, dtype in specs]
    connection = self._connection(src, timeout_s)
    uid = _direct_id(src, self.process, self.scoped(tag))
    return list(self.pull_unless_gone(src, tag, lambda: jax.block_until_ready(connection.pull(uid, shapes)),
                                       timeout_s))

  def post_direct(self, src: int, tag: str, specs: Sequence[tuple[tuple[int, ...], Any]]) -> list[jax.Array]:
    """Asks for direct message ``tag`` from process ``src`` now, without waiting: the arrays come back at once
    and are ready once the message has arrived (:meth:`wait_direct`). Asking before the offer is made is what
    takes the request's trip off the message's path (the sender's transfer server holds the request)."""
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    shapes = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding) for shape, dtype in specs]
    return list(self._connection(src, 60.0).pull(_direct_id(src, self.process, self.scoped(tag)), shapes))

  def wait_direct(self, src: int, tag: str, arrays: list[jax.Array]) -> list[jax.Array]:
    """Waits, as long as it takes, for what :meth:`post_direct` asked for (a thread that does nothing else).

    Raises:
      PeerGone: when the sender's transfer server went away.
    """
    try:
      return list(jax.block_until_ready(arrays))
    except Exception as e:  # pylint: disable=broad-except
      raise PeerGone(src, f" (process {self.process} could not pull {tag!r} from it: "
                          f"{str(e).splitlines()[0][:100]})") from None

  def recv(self, src: int, tag: str, timeout_s: float) -> list[jax.Array]:
    """The next message from process ``src`` on channel ``tag``, pulled onto this process's device.

    Raises:
      TimeoutError: when no message arrives within ``timeout_s``.
    """
    tag = self.scoped(tag)
    with self._lock:
      seq = self._received.get((src, tag), 0)
      self._received[(src, tag)] = seq + 1
    key = _MESSAGE_KEY.format(src=src, dst=self.process, tag=tag, seq=seq)
    notice = json.loads(self._get_from(src, key, timeout_s))
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
             for shape, dtype in notice["arrays"]]
    connection = self._connection(src, timeout_s)
    pull = lambda: jax.block_until_ready(connection.pull(notice["id"], specs))
    arrays = pull() if not self.recoverable else self.pull_unless_gone(src, tag, pull)
    self.delete(key)  # the acknowledgement: the sender may drop the arrays
    return list(arrays)

  def pull_unless_gone(self, src: int, tag: str, pull: Callable[[], Any], timeout_s: float | None = None) -> Any:
    """``pull()`` in a helper thread, given up (:class:`PeerGone`) if ``src`` is declared gone meanwhile (a
    recoverable job: a pull from a process that died after offering can fail, or block for good), or
    (:class:`TimeoutError`) after ``timeout_s`` when given."""
    future = _PULLS.submit(pull)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      try:
        return future.result(timeout=POLL_S)
      except concurrent.futures.TimeoutError:
        if self.recoverable and self.gone(src):
          raise PeerGone(src, f" (while process {self.process} pulled {tag!r})") from None
        if deadline is not None and time.monotonic() >= deadline:
          raise TimeoutError(f"no {tag} from process {src} within {timeout_s:g} s") from None
      except Exception as e:  # pylint: disable=broad-except  # its transfer server went away
        raise PeerGone(src, f" (process {self.process} could not pull {tag!r} from it: "
                            f"{str(e).splitlines()[0][:100]})") from None

  def _get_from(self, src: int, key: str, timeout_s: float) -> str:
    """Waits for ``key``, which process ``src`` will write; in a recoverable job, raises
    :class:`PeerGone` as soon as ``src`` is declared gone."""
    if not self.recoverable:
      return self.get(key, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        return self.get(key, min(POLL_S, max(deadline - time.monotonic(), 0.001)))
      except TimeoutError:
        if self.gone(src):
          raise PeerGone(src) from None
        if time.monotonic() >= deadline:
          raise

  def gone(self, process: int) -> bool:
    """Whether ``process`` has been declared gone (process 0's verdict, see :meth:`watch`), or the job is
    stopping (nothing more will come)."""
    return self._dead(process) or self.stopping()

  def _dead(self, process: int) -> bool:
    return process in self.dead or self.try_get(_DEAD_KEY.format(process=process)) is not None

  def declared_dead(self, process: int) -> bool:
    """Whether process 0 has declared ``process`` gone (see :meth:`watch`)."""
    return self._dead(process)

  def stopping(self) -> bool:
    """Whether process 0 is stopping the job early (:meth:`stop_job`)."""
    return self.try_get(_STOPPING_KEY) is not None

  def stop_job(self) -> None:
    """Process 0 stops the job early: every wait for another process gives up (:class:`PeerGone`)."""
    with contextlib.suppress(Exception):
      self.put(_STOPPING_KEY, "1")

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
    first real message does not pay for connecting (call it in every process, before the clock starts).

    Raises:
      PeerGone: in a recoverable job, when a peer is declared gone first.
    """
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
      self._kv.key_value_set(_FAILED_KEY.format(process=self.process), message)
    finally:
      os._exit(code)

  def close(self, timeout_s: float = 60.0) -> None:
    """Waits (up to ``timeout_s``) until every process is done, so no pull is left pending at exit.

    In a recoverable job there is no barrier (a gone process would hold it for its whole timeout): this
    process says it is closed (nothing of it will pull any more), then waits until every process not
    declared gone has said so."""
    if not self.recoverable:
      self.barrier("hetpipe_jax/close", timeout_s)
      self._offered.clear()
      return
    deadline = time.monotonic() + timeout_s

    def wait_all(key: str, processes: range) -> None:  # each has set its key, or is gone
      for p in processes:
        while not self._dead(p) and self.try_get(key.format(process=p)) is None and time.monotonic() < deadline:
          time.sleep(0.05)

    self.put(_CLOSED_KEY.format(process=self.process), "1")
    wait_all(_CLOSED_KEY, range(self.num_processes))
    self._beating = False
    self._offered.clear()
    if self.process != 0:  # leave the service before process 0, whose exit ends it (and aborts who is left)
      self.put(_BYE_KEY.format(process=self.process), "1")
      jax.distributed.shutdown()
    else:
      wait_all(_BYE_KEY, range(1, self.num_processes))
      time.sleep(0.5)  # their shutdown calls land

  # --- membership (a recoverable job: a lost process does not end the others) ---------------------------

  def beat(self) -> None:
    """Starts this process's heartbeat (a counter in the key-value store, bumped every ``BEAT_S``) for
    process 0's :meth:`watch`."""
    self.recoverable, self._beating = True, True
    key = _ALIVE_KEY.format(process=self.process)

    def loop() -> None:
      while self._beating:
        try:
          self._kv.key_value_increment(key, 1)
        except Exception:  # pylint: disable=broad-except  # the service is gone: so is the job
          return
        time.sleep(BEAT_S)

    threading.Thread(target=loop, name="heartbeat", daemon=True).start()

  def watch(self, on_gone: Callable[[int], str | None]) -> None:
    """Process 0: declares gone every process whose heartbeat stops moving for ``DEAD_AFTER_S`` (dead,
    hung or cut off), adds it to :attr:`dead` and publishes it (``dead/<process>``: peers waiting for
    it give up at once); ``on_gone(process)`` returns why the job cannot go on without it, if so. A
    process that ended itself on an error (:meth:`abort`) stops the job with its message, and a process
    may publish such a reason and go on (``fatal``). Each sets :attr:`fatal`."""
    last: dict[int, tuple[int, float]] = {}

    def loop() -> None:
      while self._beating:
        now = time.monotonic()
        for p in range(1, self.num_processes):
          if p in self.dead:
            continue
          try:
            count = self._kv.key_value_increment(_ALIVE_KEY.format(process=p), 0)
          except Exception:  # pylint: disable=broad-except
            return
          if p not in last or last[p][0] != count:
            last[p] = (count, now)
          elif now - last[p][1] > DEAD_AFTER_S and self.try_get(_CLOSED_KEY.format(process=p)) is None:
            # it ended itself on an error (abort): a bug, not a loss. The reason is set before it counts
            # as dead, so a wait sees the reason first.
            failed = self.try_get(_FAILED_KEY.format(process=p))
            self.fatal = self.fatal or (f"process {p}: {failed}" if failed else on_gone(p))
            self.dead.add(p)
            self.put(_DEAD_KEY.format(process=p), "1")
        self.fatal = self.fatal or self.try_get(_FATAL_KEY)
        time.sleep(POLL_S)

    threading.Thread(target=loop, name="watch", daemon=True).start()

  def publish_fatal(self, message: str) -> None:
    """Tells process 0 why the job cannot go on (the first reason published wins)."""
    with contextlib.suppress(Exception):  # another one was first
      self.put(_FATAL_KEY, message)


_CURRENT: list[Node] = []  # the Node of this process, once it has joined


def _direct_id(src: int, dst: int, tag: str) -> int:
  """The transfer id of direct message ``tag`` from ``src`` to ``dst``: a 62-bit hash with bit 62 set, apart
  from the small counted ids of :meth:`Node.send`."""
  digest = hashlib.blake2b(f"{src}>{dst}>{tag}".encode(), digest_size=8).digest()
  return (int.from_bytes(digest, "big") & ((1 << 62) - 1)) | (1 << 62)


def current_node() -> Node | None:
  """This process's :class:`Node` if it joined a job, else None."""
  return _CURRENT[0] if _CURRENT else None


def join(coordinator: str, num_processes: int, process: int, local_devices: int,
         heartbeat_timeout_s: int = 10, init_timeout_s: int = 60, recoverable: bool = False) -> Node:
  """Joins the job as process ``process`` of ``num_processes`` with ``local_devices`` CPU devices.

  Must run before anything else uses JAX in this process.

  Args:
    coordinator: ``HOST:PORT`` of the coordination service (process 0 hosts it).
    num_processes: processes in the job.
    process: this process's index, 0 .. num_processes - 1.
    local_devices: CPU devices this process holds (the GPUs of its node, emulated).
    heartbeat_timeout_s: a process silent this long counts as dead (JAX's default is 100 s).
    init_timeout_s: how long to wait for every process to arrive.
    recoverable: a lost process (other than process 0, which hosts the coordination service) does not
      end the others (JAX's ``jax_enable_recoverability``); they learn of it through :meth:`Node.watch`.

  Raises:
    ConfigError: for a process index out of range.
  """
  die_with_launcher()
  if not 0 <= process < num_processes:
    raise ConfigError(f"process_id={process} is outside 0..{num_processes - 1}; give each of the "
                      f"{num_processes} processes a distinct id in that range")
  jax.config.update("jax_num_cpu_devices", local_devices)
  jax.config.update("jax_enable_recoverability", recoverable)
  jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             initialization_timeout=init_timeout_s)
  node = Node(process, num_processes, jax.local_devices()[0])
  if recoverable:
    node.beat()
  _CURRENT[:] = [node]
  return node
