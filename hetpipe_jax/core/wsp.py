"""Wave Synchronous Parallel: the clock, the gate and the staleness bounds, as pure functions.

HetPipe (Park et al., USENIX ATC 2020, section 4) runs virtual workers (VWs) in data parallel under WSP.
Wave c of a VW is its minibatches c*Nm+1 .. (c+1)*Nm; the VW's clock c_local counts the waves it has
pushed, and c_global is the minimum over VWs. The injection of minibatch (c+2)*Nm, the first one after the
push of wave c, waits until c_local - c_global <= D (the gate); then the VW pulls.

Written optax-style: state is a NamedTuple, ``init`` and ``push`` are pure, everything else reads state::

  state = wsp.init(num_vws=2)
  state = wsp.push(state, vw=0)          # VW 0 pushed wave 0
  wsp.gate_open(state, vw=0, d=0)        # False: c_local(0) - c_global = 1 > 0

Guarantees, for minibatch p of VW i in wave w = (p-1)//Nm (docs/PROTOCOL.md section 3.7): own updates 1..p-Nm are
included (local staleness <= Nm-1); every VW's waves 0..w-D-2 are included (0..w-D-1 if p is the last of
its wave); hence the global staleness bound (D+2)*Nm-2 minibatches, which is tight.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

from hetpipe_jax.errors import ProtocolError

CHUNK = 64  # clocks per chunk of :class:`Clocks`


class Clocks(Sequence[int]):
  """Every VW's clock, immutable and persistent: :meth:`set` returns new clocks that share all chunks of ``CHUNK``
  clocks but one with these, so a push costs O(N / CHUNK + CHUNK), where a tuple copies all N (9 us a push at
  2,048 VWs, 45 us in the checker at 16,384 GPUs: issue 42). Reads as the tuple of its clocks: indexes, iterates,
  compares equal to (and hashes as) that tuple, prints as it."""

  __slots__ = ("_chunks", "_n")

  def __init__(self, clocks: Iterable[int] = ()):
    c = tuple(clocks)
    self._chunks = tuple(c[k:k + CHUNK] for k in range(0, len(c), CHUNK))
    self._n = len(c)

  def __len__(self) -> int:
    return self._n

  @overload
  def __getitem__(self, i: int) -> int: ...

  @overload
  def __getitem__(self, i: slice) -> tuple[int, ...]: ...

  def __getitem__(self, i: Any) -> Any:
    if isinstance(i, slice):
      return tuple(self)[i]
    if i < 0:
      i += self._n
      if i < 0:
        raise IndexError("clock index out of range")
    return self._chunks[i // CHUNK][i % CHUNK]

  def __iter__(self) -> Iterator[int]:
    return itertools.chain.from_iterable(self._chunks)

  def __eq__(self, other: object) -> bool:
    if isinstance(other, Clocks):
      return self._chunks == other._chunks  # (the same length: the same chunking)
    return tuple(self) == other if isinstance(other, tuple) else NotImplemented

  def __hash__(self) -> int:
    return hash(tuple(self))

  def __repr__(self) -> str:
    return repr(tuple(self))

  def __reduce__(self) -> tuple[Any, ...]:
    return Clocks, (tuple(self),)

  def set(self, i: int, clock: int) -> Clocks:
    """These clocks with VW ``i``'s (0 <= i < N) set to ``clock``."""
    k, r = divmod(i, CHUNK)
    chunk = self._chunks[k]
    new = object.__new__(Clocks)
    new._chunks, new._n = self._chunks[:k] + (chunk[:r] + (clock,) + chunk[r + 1:],) + self._chunks[k + 1:], self._n
    return new


class ClockState(NamedTuple):
  """Clocks of all virtual workers: ``c_local[i]`` = waves VW i has pushed; ``left``: the VWs that left
  (membership, docs/PROTOCOL.md section 3.8): their clocks are frozen and no longer count. ``low`` is the
  global clock (the minimum of the clocks that count) and ``at_low`` how many clocks that count sit at it, kept
  as the clocks change so that the global clock, the gate and a gap take O(1) (a push recounts only when the
  last clock at the minimum moves: amortised O(1)). ``seq`` counts the changes of ``c_local`` so far (pushes
  and joins, in the order they were applied): the position of a snapshot of the clocks in that order, which a
  trace of version 2 records instead of the clocks themselves (docs/PROTOCOL.md section 8). Build one with
  :func:`init` or :func:`restore`."""

  c_local: Clocks
  left: frozenset[int]
  low: int
  at_low: int
  seq: int


def _counted(c_local: Sequence[int], left: frozenset[int]) -> list[int]:
  """The clocks that count in the global clock: the live VWs' (all of them, if none is live)."""
  if not left:
    return list(c_local)
  live = [c for i, c in enumerate(c_local) if i not in left]
  return live or list(c_local)


def restore(c_local: Sequence[int], left: frozenset[int] = frozenset(), seq: int = 0) -> ClockState:
  """The clock state of these clocks and departed VWs after ``seq`` changes (O(N): a checkpoint's clocks)."""
  clocks = c_local if isinstance(c_local, Clocks) else Clocks(c_local)
  counted = _counted(clocks, frozenset(left))
  low = min(counted)
  return ClockState(clocks, frozenset(left), low, counted.count(low), seq)


def init(num_vws: int) -> ClockState:
  """All clocks start at 0."""
  return ClockState(Clocks((0,) * num_vws), frozenset(), 0, num_vws, 0)


def c_global(state: ClockState) -> int:
  """The global clock: the minimum of the local clocks of the live virtual workers (of all, if none is
  live)."""
  return state.low


def leave(state: ClockState, vw: int) -> ClockState:
  """VW ``vw`` left: its clock is frozen and no longer counts in c_global."""
  return restore(state.c_local, state.left | {vw}, state.seq)


def join(state: ClockState, vw: int, clock: int | None = None) -> ClockState:
  """VW ``vw`` (re)joins: it takes c_local = ``clock``, by default c_global of the live ones (its first
  wave is that value; a trace replay passes the clock the trace recorded)."""
  c = list(state.c_local)
  if clock is not None:
    c[vw] = clock
  elif len(state.left | {vw}) < len(c):
    c[vw] = leave(state, vw).low
  return restore(c, state.left - {vw}, state.seq + 1)


def push(state: ClockState, vw: int, wave: int | None = None) -> ClockState:
  """VW ``vw`` pushed one more wave (``wave``, when given, must be its next one): its local clock ticks.

  Raises:
    ProtocolError: when ``wave`` is not ``c_local(vw)``: waves are pushed once each, in order.
  """
  before = state.c_local[vw]
  if wave is not None and wave != before:
    raise ProtocolError(f"VW {vw} pushed wave {wave} but its clock is {before}; waves are pushed "
                        "once each, in order")
  c = state.c_local.set(vw, before + 1)
  counts = vw not in state.left or len(state.left) == len(c)
  if not counts or before != state.low:
    return state._replace(c_local=c, seq=state.seq + 1)
  if state.at_low > 1:
    return state._replace(c_local=c, at_low=state.at_low - 1, seq=state.seq + 1)
  return restore(c, state.left, state.seq + 1)  # the last clock at the minimum moved: the global clock rises


def clock_gap(state: ClockState, vw: int) -> int:
  """c_local(vw) - c_global: how far ``vw`` runs ahead of the slowest virtual worker."""
  return state.c_local[vw] - c_global(state)


def gate_open(state: ClockState, vw: int, d: int) -> bool:
  """Whether ``vw`` may make its gated injection: c_local(vw) - c_global <= D."""
  return clock_gap(state, vw) <= d


def wave_of(mb: int, nm: int) -> int:
  """The wave of minibatch ``mb`` (counted from 1); waves count from 0."""
  return (mb - 1) // nm


def is_wave_end(mb: int, nm: int) -> bool:
  """Whether ``mb`` is the last minibatch of its wave (its completion pushes the wave)."""
  return mb % nm == 0


def is_gated(mb: int, nm: int) -> bool:
  """Whether injecting ``mb`` must pass the gate: (c+2)*Nm for c >= 0, the first injection after a push."""
  return mb > nm and mb % nm == 0


def min_global_waves(mb: int, nm: int, d: int) -> int:
  """Fewest waves of every VW that the weights of ``mb``'s forward pass must include."""
  w = wave_of(mb, nm)
  return max(0, w - d) if is_wave_end(mb, nm) else max(0, w - d - 1)


def global_staleness_bound(nm: int, d: int) -> int:
  """The tight bound on global staleness in minibatches: (D+2)*Nm - 2."""
  return (d + 2) * nm - 2


def local_staleness_bound(nm: int) -> int:
  """Own updates missing from a forward pass: at most Nm - 1."""
  return nm - 1
