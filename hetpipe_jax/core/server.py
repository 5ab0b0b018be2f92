"""What the engine needs of a parameter server, and the clock-only server of runs without numerics.

A server holds the WSP clocks (:mod:`hetpipe_jax.core.wsp`) and, when it holds weights, applies every
pushed wave to them (:class:`hetpipe_jax.runtime.numerics.ps.ParameterServer`). :class:`ClockServer` holds the
clocks only: the ``sim`` executor and schedule-only tests use it. Both enforce the same rules: each
wave of a virtual worker pushed once and in clock order; a pull only through the gate
c_local - c_global <= D.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from hetpipe_jax.core import wsp


class Snapshot(NamedTuple):
  """What a pull returns: the global weights (one entry per shard; None without numerics) and the
  waves of each virtual worker they contain."""

  params: tuple[Any, ...] | None
  waves: Sequence[int]  # (the PS's clocks as they are: immutable)
  seq: int = 0  # the clocks' changes they hold (:attr:`hetpipe_jax.core.wsp.ClockState.seq`)


class Server(Protocol):
  """The parameter server as the engine sees it."""

  d: int
  num_shards: int
  dropped: dict[tuple[int, int], list[int]]  # (vw, wave) -> units of a push refused as non-finite, skipped

  @property
  def clock(self) -> wsp.ClockState:
    """The clocks of every virtual worker."""
    ...

  def push(self, vw: int, wave: int, updates: Mapping[int, Any]) -> wsp.ClockState:
    """Applies VW ``vw``'s wave ``wave`` (``updates``: shard -> summed update); returns the new clocks."""
    ...

  def try_pull(self, vw: int) -> Snapshot | None:
    """The global weights if ``vw`` passes the gate now, else None."""
    ...

  def leave(self, vw: int) -> wsp.ClockState:
    """``vw`` left: its clock no longer counts (its pushed waves stay applied)."""
    ...

  def join(self, vw: int) -> wsp.ClockState:
    """``vw`` (re)joins at the current global clock."""
    ...


class ClockServer:
  """WSP clocks without weights: pushes carry no numbers.

  Args:
    num_vws: number of virtual workers.
    d: the clock distance bound D >= 0.
    num_shards: shards a push covers (recorded in the trace's push events).
  """

  def __init__(self, num_vws: int, d: int, num_shards: int = 0):
    self.d, self.num_shards = d, num_shards
    self._clock = wsp.init(num_vws)
    self.dropped: dict[tuple[int, int], list[int]] = {}  # no numbers, nothing to drop

  @property
  def clock(self) -> wsp.ClockState:
    return self._clock

  def push(self, vw: int, wave: int, updates: Mapping[int, Any] | None = None) -> wsp.ClockState:
    """Ticks ``vw``'s clock (``updates`` are ignored).

    Raises:
      ProtocolError: when ``wave`` is not ``vw``'s next wave.
    """
    del updates
    self._clock = wsp.push(self._clock, vw, wave)
    return self._clock

  def leave(self, vw: int) -> wsp.ClockState:
    self._clock = wsp.leave(self._clock, vw)
    return self._clock

  def join(self, vw: int) -> wsp.ClockState:
    self._clock = wsp.join(self._clock, vw)
    return self._clock

  def try_pull(self, vw: int) -> Snapshot | None:
    if not wsp.gate_open(self._clock, vw, self.d):
      return None
    return Snapshot(None, self._clock.c_local, self._clock.seq)
