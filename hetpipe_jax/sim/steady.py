"""The ``sim`` executor's fast mode: simulate until the waves settle, then extrapolate.

Under WSP every virtual worker settles into a steady wave period (HETPIPE.md section 3: in the long run
every virtual worker moves at the slowest one's wave rate, a faster one running at most D + 1 waves
ahead). The event simulation of the first waves holds the fill transient and any run-ahead; after that a
wave repeats the one before it. Fast mode runs the full event simulation (the same engine, links and
trace as always) until every virtual worker's period over its last ``window`` waves agrees with its
period over the ``window`` waves before within ``rtol``; then it stops injecting (each virtual worker
finishes the wave it began, so the trace is complete and the checker reads it as any run), and the end
of the whole run is extrapolated per virtual worker::

    T(W) = max_i  p_i + (W - w_i) x P_i

for virtual worker i's last push time p_i after w_i waves and its settled period P_i. A run that never
settles is simulated to the end. Cost: the waves up to settling instead of all ``W``; validated against
the full simulation by ``python -m experiments.validate_fast`` (throughput error per configuration).
"""

from __future__ import annotations

import math

WINDOW = 4  # waves per period estimate
RTOL = 1e-3  # two consecutive estimates agree this closely: settled


class SteadyState:
  """Push times of every virtual worker; says when the wave periods have settled, and extrapolates.

  Args:
    num_vws: virtual workers.
    waves: the waves each virtual worker runs in the whole run (W).
    window / rtol: see the module docstring.
  """

  def __init__(self, num_vws: int, waves: int, window: int = WINDOW, rtol: float = RTOL):
    self.waves, self.window, self.rtol = waves, window, rtol
    self.pushes: list[list[float]] = [[] for _ in range(num_vws)]
    self.stopped_at: list[int] | None = None  # waves pushed per virtual worker when it settled

  def push(self, vw: int, t: float) -> None:
    """Virtual worker ``vw`` pushed its next wave at ``t``."""
    self.pushes[vw].append(t)

  def _period(self, times: list[float], end: int) -> float:
    return (times[end - 1] - times[end - 1 - self.window]) / self.window

  def settled(self) -> bool:
    """Every virtual worker has two consecutive window periods that agree (checked after each push;
    remembers how far each had got the first time it says yes)."""
    if self.stopped_at is not None:
      return True
    for times in self.pushes:
      n = len(times)
      if n < 2 * self.window + 1 or n >= self.waves:
        return False
      now, before = self._period(times, n), self._period(times, n - self.window)
      if abs(now - before) > self.rtol * now:
        return False
    self.stopped_at = [len(times) for times in self.pushes]
    return True

  def _stopped_at(self) -> list[int]:
    if self.stopped_at is None:
      raise ValueError("the waves have not settled: nothing to extrapolate")
    return self.stopped_at

  def ends(self) -> list[float]:
    """Every virtual worker's extrapolated last push (only after :meth:`settled`)."""
    return [times[n - 1] + (self.waves - n) * self._period(times, n)
            for times, n in zip(self.pushes, self._stopped_at())]

  def period(self) -> float:
    """The settled wave period of the virtual worker that ends last."""
    ends = self.ends()
    last = max(range(len(ends)), key=ends.__getitem__)
    return self._period(self.pushes[last], self._stopped_at()[last])

  def tail_waves(self) -> int:
    """Waves of the last virtual worker after the first one ends: with D > 0 a faster virtual worker may
    run up to D + 1 waves ahead and finish first, and the rest then run without it (a different state,
    so the extrapolation of the settled period does not hold there)."""
    ends = self.ends()
    return math.ceil((max(ends) - min(ends)) / self.period() - self.rtol)
