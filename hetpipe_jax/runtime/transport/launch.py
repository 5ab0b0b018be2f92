"""Starts the processes of a job on this host and watches them: one failure or a hang ends all of them.

Without a coordinator address, a multi-process run starts one OS process per node of its cluster here
(loopback). The launcher gives every process the coordinator address, the job size and its index, waits,
and guarantees three things: when a process fails, every other process is stopped within ``grace_s``
(they notice the loss themselves through the coordination service's heartbeat, or are killed); when the
job runs past ``timeout_s``, every process is killed; and no child outlives the launcher. It reports one
line naming the lost node and process, with the reason the failed process gave (:func:`record_reason`).

A process that hangs (stopped, or stuck without heartbeats) is found too: the coordination service ends
the others (SIGABRT) within its heartbeat timeout, and a process still running ``settle_s`` after every
other one has stopped that way is the hung one.

A *survivable* job (a training job with membership: its processes join with ``recoverable=True``) is
process 0's to end: another process that dies or hangs does not end it (process 0's clock lets its
virtual workers leave, or stops the job itself, saying why); once process 0 has exited, the others get
``settle_s`` to follow and are then killed, and the report lists every process the job went on without.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hetpipe_jax.errors import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nobody listens on now (for the coordinator on loopback)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def check_port_free(address: str) -> None:
  """Raises ConfigError when ``HOST:PORT`` is already taken on this host."""
  host, _, port = address.rpartition(":")
  if not port.isdigit():
    raise ConfigError(f"coordinator address {address!r} must be HOST:PORT, e.g. 10.0.0.1:7777")
  with socket.socket() as s:
    try:
      s.bind((host or "0.0.0.0", int(port)))
    except OSError as e:
      raise ConfigError(f"coordinator port {port} on {host or 'this host'} is in use ({e.strerror}); choose "
                        "another --coordinator_address port or stop what holds it") from None


@dataclasses.dataclass
class JobResult:
  """How a launched job ended."""

  returncodes: list[int | None]  # per process; negative: killed by that signal
  failed: int | None  # the first process that failed (None: all succeeded)
  message: str  # one line: "ok", or what went wrong and where
  seconds: float

  lost: list[str] = dataclasses.field(default_factory=list)  # survivable jobs: processes the job went on without

  @property
  def ok(self) -> bool:
    return self.failed is None

  @property
  def stopped(self) -> bool:
    """A survivable job whose process 0 exited with code 1: it stopped the job and said why itself."""
    return self.returncodes[0] == 1


LAUNCHER_ENV = "HETPIPE_LAUNCHER_PID"  # set in every launched process: the launcher's pid
INDEX_ENV = "HETPIPE_LAUNCH_INDEX"  # set in every launched process: its index in the job
REASONS_ENV = "HETPIPE_LAUNCH_REASONS"  # set in every launched process: where it records why it failed


def record_reason(message: str) -> None:
  """Called by a launched process that is about to fail: its launcher's report quotes ``message``."""
  folder, index = os.environ.get(REASONS_ENV), os.environ.get(INDEX_ENV)
  if folder and index:
    try:
      with open(os.path.join(folder, index), "w", encoding="utf-8") as f:
        f.write(" ".join(message.split()))
    except OSError:
      pass  # the launcher is gone or its folder with it: nobody to report to


def _reason(folder: str, index: int) -> str | None:
  try:
    with open(os.path.join(folder, str(index)), encoding="utf-8") as f:
      return f.read().strip() or None
  except OSError:
    return None


def child_environment() -> dict[str, str]:
  """This process's environment without the CPU-device settings: each launched process sets its own
  device count (``join`` does), so an inherited ``XLA_FLAGS``/``JAX_PLATFORMS`` must not override it."""
  return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def die_with_launcher() -> None:
  """Called early in a launched process: on Linux it gets SIGKILL when its launcher dies, however the
  launcher dies (no orphans). A process not started by :func:`launch` is left alone.

  (Set in the child itself: a ``preexec_fn`` would fork a multithreaded JAX process.)
  """
  launcher = os.environ.get(LAUNCHER_ENV)
  if not launcher:
    return
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    return  # not Linux: the launcher's own clean-up still kills its children on every normal exit
  if os.getppid() != int(launcher):  # the launcher died before the line above
    os._exit(1)


def _raise_on_sigterm(signum, frame) -> None:
  del frame
  raise SystemExit(128 + signum)


def _first_failure(procs: Sequence[subprocess.Popen]) -> int | None:
  """The process to blame among those that have failed by now: one killed from outside (a signal) before
  one that exited with an error, before one that aborted (SIGABRT: how JAX ends the survivors of a lost
  peer); then the lowest index."""
  rank = lambda code: 2 if code == -signal.SIGABRT else 0 if code < 0 else 1
  failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
  return min(failed, key=lambda i: (rank(procs[i].returncode), i)) if failed else None


def _hung(procs: Sequence[subprocess.Popen]) -> list[int]:
  """The processes still running when every other one has been ended by SIGABRT (how the coordination
  service ends the survivors of a peer that stopped heartbeating): those are the hung ones."""
  running = [i for i, p in enumerate(procs) if p.poll() is None]
  ended = [p.returncode for p in procs if p.returncode is not None]
  return running if running and ended and all(code == -signal.SIGABRT for code in ended) else []


def launch(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], timeout_s: float,
           grace_s: float = 60.0, names: Sequence[str] | None = None,
           output: Callable[[int], tuple[int | None, int | None]] | None = None,
           settle_s: float = 5.0, survivable: bool = False) -> JobResult:
  """Runs one process per command and waits for all of them.

  Args:
    commands: the argv of every process.
    envs: the full environment of every process.
    timeout_s: the whole job's limit; past it every process is killed.
    grace_s: after a process fails, how long the others may take to stop on their own before they
      are killed.
    names: a readable name per process for the report (e.g. its node).
    output: ``index -> (stdout fd, stderr fd)`` for each process (default: inherit this process's).
    settle_s: how long processes may keep running after every other one was ended by SIGABRT before
      they count as hung (survivable: after process 0 exited).
    survivable: process 0 decides (see the module docstring): the job failed iff process 0 failed.

  Returns:
    A :class:`JobResult`; ``message`` names the first failed process, or the hung ones.
  """
  names = list(names or [f"process {i}" for i in range(len(commands))])
  procs: list[subprocess.Popen] = []
  t0 = time.monotonic()
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if main_thread else None  # clean up on SIGTERM
  reasons = tempfile.mkdtemp(prefix="hetpipe_launch_")
  try:
    for i, (cmd, env) in enumerate(zip(commands, envs)):
      out, err = output(i) if output else (None, None)
      env = {**env, LAUNCHER_ENV: str(os.getpid()), INDEX_ENV: str(i), REASONS_ENV: reasons}
      procs.append(subprocess.Popen(list(cmd), env=env, stdout=out, stderr=err, start_new_session=True))
    failed, lost_first = _watch(procs, t0 + timeout_s, grace_s, settle_s, survivable)
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    if survivable:
      failed = None if procs[0].poll() == 0 else 0
    elif failed is None:  # one may have failed in the last moment
      failed = _first_failure(procs)
    if hung and _hung(procs):  # the others were ended because these stopped answering
      failed = hung[0]
    ending = _Ending(failed, hung, _reason(reasons, failed) if failed is not None else None, lost_first)
  finally:
    if main_thread:
      signal.signal(signal.SIGTERM, previous)
    for p in procs:  # no orphans, whatever happened (KeyboardInterrupt, SIGTERM included)
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    shutil.rmtree(reasons, ignore_errors=True)
  limits = (timeout_s, grace_s)
  return _result(names, [p.returncode for p in procs], ending, limits, survivable, time.monotonic() - t0)


def _watch(procs: Sequence[subprocess.Popen], deadline: float, grace_s: float, settle_s: float,
           survivable: bool) -> tuple[int | None, set[int]]:
  """Waits until every process has ended, or the job must end (see :func:`launch`).

  Returns:
    (the first process that failed, not survivable: None; survivable: the processes other than 0 that
    ended with an error while process 0 ran).
  """
  failed: int | None = None
  stalled_since = None  # when only hung-looking processes were left running
  ended0 = None  # survivable: when process 0 ended
  lost_first: set[int] = set()
  while any(p.poll() is None for p in procs):
    now = time.monotonic()
    if ended0 is None:
      lost_first.update(i for i, p in enumerate(procs) if i > 0 and p.poll() not in (None, 0))
    if survivable and procs[0].poll() is not None:
      ended0 = ended0 or now
      if now >= min(deadline, ended0 + settle_s):
        break
      time.sleep(0.05)
      continue
    if failed is None and not survivable:
      failed = _first_failure(procs)
      if failed is not None:
        deadline = min(deadline, now + grace_s)
    stalled_since = (stalled_since or now) if _hung(procs) else None
    if now >= deadline or (stalled_since is not None and now - stalled_since >= settle_s):
      break
    time.sleep(0.05)
  return failed, lost_first


class _Ending(NamedTuple):
  """How the processes ended, as :func:`launch` found: the one to blame, those still running when it
  stopped waiting (then killed), the reason the one to blame gave, and (survivable) those lost first."""

  failed: int | None
  hung: list[int]
  reason: str | None
  lost_first: set[int]


def _result(names: list[str], codes: list[int | None], ending: _Ending, limits: tuple[float, float],
            survivable: bool, seconds: float) -> JobResult:
  """The job's :class:`JobResult`, its one-line message naming what went wrong and where."""
  (timeout_s, grace_s), (failed, hung, reason, lost_first) = limits, ending
  lost = [f"{names[i]} (process {i}) " + ("hung (killed)" if i in hung else _how(codes[i]))
          for i in range(1, len(codes)) if survivable and (i in hung or i in lost_first)]
  if failed is not None and failed in hung:
    message = (f"{names[failed]} (process {failed}) hung: it stopped answering and the others were ended "
               "(SIGABRT from the coordination service); killed it")
  elif failed is not None:
    message = (f"{names[failed]} (process {failed}) {_how(codes[failed])}" + (f" ({reason})" if reason else "")
               + "; the job stopped"
               + (f" (killed {', '.join(names[i] for i in hung)} after {grace_s:g} s)" if hung else ""))
  elif hung and not survivable:  # survivable: process 0 ended fine; the ones still running are lost
    message = f"{', '.join(names[i] for i in hung)} still running after {timeout_s:g} s; killed the job"
    failed = hung[0]
  else:
    message = "ok"
  return JobResult(codes, failed, message, seconds, lost)


def _how(code: int | None) -> str:
  return f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
