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

from typing import NamedTuple

from hetpipe_jax.errors import ProtocolError


class ClockState(NamedTuple):
  """Clocks of all virtual workers: ``c_local[i]`` = waves VW i has pushed; ``left``: the VWs that left
  (membership, docs/PROTOCOL.md section 3.8): their clocks are frozen and no longer count."""

  c_local: tuple[int, ...]
  left: frozenset[int] = frozenset()


def init(num_vws: int) -> ClockState:
  """All clocks start at 0."""
  return ClockState(c_local=(0,) * num_vws)


def c_global(state: ClockState) -> int:
  """The global clock: the minimum of the local clocks of the live virtual workers (of all, if none is
  live)."""
  if not state.left:
    return min(state.c_local)
  live = [c for i, c in enumerate(state.c_local) if i not in state.left]
  return min(live) if live else min(state.c_local)


def leave(state: ClockState, vw: int) -> ClockState:
  """VW ``vw`` left: its clock is frozen and no longer counts in c_global."""
  return state._replace(left=state.left | {vw})


def join(state: ClockState, vw: int, clock: int | None = None) -> ClockState:
  """VW ``vw`` (re)joins: it takes c_local = ``clock``, by default c_global of the live ones (its first
  wave is that value; a trace replay passes the clock the trace recorded)."""
  live = state._replace(left=state.left | {vw})
  c = list(state.c_local)
  if clock is not None:
    c[vw] = clock
  elif len(live.left) < len(c):
    c[vw] = c_global(live)
  return ClockState(tuple(c), state.left - {vw})


def push(state: ClockState, vw: int, wave: int | None = None) -> ClockState:
  """VW ``vw`` pushed one more wave (``wave``, when given, must be its next one): its local clock ticks.

  Raises:
    ProtocolError: when ``wave`` is not ``c_local(vw)``: waves are pushed once each, in order.
  """
  if wave is not None and wave != state.c_local[vw]:
    raise ProtocolError(f"VW {vw} pushed wave {wave} but its clock is {state.c_local[vw]}; waves are pushed "
                        "once each, in order")
  c = list(state.c_local)
  c[vw] += 1
  return state._replace(c_local=tuple(c))


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
