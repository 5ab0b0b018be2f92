"""The ``sim`` executor's fast mode: simulate until the waves settle, then extrapolate.

Under WSP every virtual worker settles into a steady wave period (docs/PROTOCOL.md section 3.7: in the long run
every virtual worker moves at the slowest one's wave rate, a faster one running at most D + 1 waves
ahead). The event simulation of the first waves holds the fill transient and any run-ahead; after that
the waves repeat. Fast mode runs the full event simulation (the same engine, links and trace as always)
until every virtual worker's wave periods repeat: its last three cycles of L periods agree, wave for
wave within ``rtol``, for some cycle L <= ``max_cycle`` (contention between virtual workers of different
speeds often makes a cycle of a few waves). Then it stops injecting (the minibatches in flight complete, so
the trace is a complete shorter run and the checker reads it as any run), and the end of the whole run is
extrapolated per virtual worker::

    T(W) = max_i  p_i + (W - w_i) x P_i

for virtual worker i's last push time p_i after w_i waves and its settled period P_i (the mean over its
cycle). A run that never settles is simulated to the end. Cost: the waves up to settling instead of all
``W``; checked against the full simulation by ``python -m experiments.validate_fast`` (the throughput
error of every study configuration).
"""

from __future__ import annotations

import math

MAX_CYCLE = 8  # the longest repeating cycle of wave periods looked for, in waves
RTOL = 1e-3  # the cycles agree this closely, wave for wave: settled
REPEATS = 3  # cycles that must agree


class SteadyState:
  """Push times of every virtual worker; says when the wave periods have settled, and extrapolates.

  Args:
    num_vws: virtual workers.
    waves: the waves each virtual worker runs in the whole run (W).
    max_cycle / rtol: see the module docstring.
  """

  def __init__(self, num_vws: int, waves: int, max_cycle: int = MAX_CYCLE, rtol: float = RTOL):
    self.waves, self.max_cycle, self.rtol = waves, max_cycle, rtol
    self.pushes: list[list[float]] = [[] for _ in range(num_vws)]
    self.stopped_at: list[int] | None = None  # waves pushed per virtual worker when it settled
    self.cycles: list[int] | None = None  # the cycle length of each virtual worker then
    self._pushed = False  # a push since settled() last looked

  def push(self, vw: int, t: float) -> None:
    """Virtual worker ``vw`` pushed its next wave at ``t``."""
    self.pushes[vw].append(t)
    self._pushed = True

  def _cycle(self, times: list[float]) -> int | None:
    """The shortest L <= max_cycle whose last three cycles of L wave periods agree, wave for wave."""
    for cycle in range(1, self.max_cycle + 1):
      if len(times) < REPEATS * cycle + 2:  # the first push ends the fill: periods from the second on
        return None
      last = [times[-j] - times[-j - 1] for j in range(1, REPEATS * cycle + 1)]
      if all(abs(last[j] - last[j + cycle]) <= self.rtol * last[j] for j in range((REPEATS - 1) * cycle)):
        return cycle
    return None

  def _period(self, times: list[float], end: int, cycle: int) -> float:
    return (times[end - 1] - times[end - 1 - cycle]) / cycle

  def settled(self) -> bool:
    """Every virtual worker's wave periods repeat in a cycle (checked after each push; remembers how far
    each had got the first time it says yes)."""
    if self.stopped_at is not None:
      return True
    if not self._pushed:  # nothing new since the last answer
      return False
    self._pushed = False
    cycles = []
    for times in self.pushes:
      cycle = self._cycle(times) if len(times) < self.waves else None
      if cycle is None:
        return False
      cycles.append(cycle)
    self.stopped_at, self.cycles = [len(times) for times in self.pushes], cycles
    return True

  def _settled_state(self) -> tuple[list[int], list[int]]:
    if self.stopped_at is None or self.cycles is None:
      raise ValueError("the waves have not settled: nothing to extrapolate")
    return self.stopped_at, self.cycles

  def ends(self) -> list[float]:
    """Every virtual worker's extrapolated last push (only after :meth:`settled`)."""
    stopped_at, cycles = self._settled_state()
    return [times[n - 1] + (self.waves - n) * self._period(times, n, cycle)
            for times, n, cycle in zip(self.pushes, stopped_at, cycles)]

  def period(self) -> float:
    """The settled wave period (mean over its cycle) of the virtual worker that ends last."""
    stopped_at, cycles = self._settled_state()
    ends = self.ends()
    last = max(range(len(ends)), key=ends.__getitem__)
    return self._period(self.pushes[last], stopped_at[last], cycles[last])

  def tail_waves(self) -> int:
    """Waves of the last virtual worker after the first one ends: with D > 0 a faster virtual worker may
    run up to D + 1 waves ahead and finish first, and the rest then run without it (a different state,
    so the extrapolation of the settled period does not hold there)."""
    ends = self.ends()
    return math.ceil((max(ends) - min(ends)) / self.period() - self.rtol)
