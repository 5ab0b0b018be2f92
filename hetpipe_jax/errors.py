"""The error types: a configuration that cannot run, a run stopped on purpose (say why in one line), and a
breach of the pipeline or WSP protocol."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the value, the limit and what to change."""


class RunStopped(RuntimeError):
  """A run stopped on purpose, not by a bug: the message says why and what to change."""


class LostAtStart(RunStopped):
  """A process was gone before a part of a multi-process run started its clocks: nothing of the part ran."""

  def __init__(self, process: int):
    super().__init__(f"process {process} was lost as a part of the run started; run again with every process")
    self.process = process


class NonFiniteUpdate(RunStopped):
  """A pushed wave update holds NaN or Inf; it was refused before it touched the global weights.

  Attributes:
    vw, wave: whose push.
    units: the units (PS shards) whose update is not finite.
    clock: the global clock of the weights, which are unchanged (the last good one).
  """

  def __init__(self, vw: int, wave: int, units: list[int], clock: int, message: str | None = None):
    super().__init__(message or f"VW {vw} pushed a non-finite update (NaN or Inf) in wave {wave}, units {units}; "
                     f"refused: the global weights are those of global clock {clock}")
    self.vw, self.wave, self.units, self.clock = vw, wave, units, clock

  def with_stages(self, cuts) -> "NonFiniteUpdate":
    """The same error, its message naming the stages too, given the virtual worker's unit boundaries."""
    stages = sorted({j for j in range(len(cuts) - 1) for u in self.units if cuts[j] <= u < cuts[j + 1]})
    return NonFiniteUpdate(self.vw, self.wave, self.units, self.clock, (
        f"VW {self.vw} pushed a non-finite update (NaN or Inf) in wave {self.wave}: stage "
        f"{', '.join(map(str, stages))}, unit {', '.join(map(str, self.units))}; refused, so the global weights "
        f"are those of global clock {self.clock}, the last good one; lower the learning rate, or drop such "
        "waves with on_nonfinite='skip'"))


class ProtocolError(RuntimeError):
  """A breach of the pipeline or WSP protocol at run time (a wave pushed twice or out of order, a
  minibatch completed out of order, an executor that stalled): a bug in the runtime, never bad input."""

