"""The transport protocol: how pushes, pulls and stage-to-stage tensors move, and when they arrive.

The engine hands every push and pull to a :class:`Comm` and goes on when the Comm calls ``done(t)``
with the time the transfer completed; the numerics move activations and gradients between the devices
of neighbouring stages through :meth:`Comm.move`. Implementations:

* :class:`InstantComm` (here): pushes and pulls take no time; ``move`` is the identity;
* :class:`hetpipe_jax.runtime.numerics.device_comm.DeviceComm`: in one process, ``move`` is ``jax.device_put``
  onto the receiving stage's device;
* :class:`hetpipe_jax.sim.network.SimComm`: pushes and pulls are flows over the simulated links, done
  when their last byte lands; with ``staged``, a :class:`StagedComm`: each stage's part moves on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Done = Callable[[float], None]  # called with the time a push or pull completed
StageId = tuple[int, int]  # (virtual worker, stage)


class Comm(Protocol):
  """Moves a virtual worker's pushes and pulls (timing) and its stage-to-stage tensors (data).

  Attributes:
    staged: whether it moves each stage's part of a push or pull on its own (then it is a
      :class:`StagedComm`, and the engine calls its staged methods instead of ``push`` and ``pull``).
  """

  staged: bool

  def push(self, vw: int, wave: int, t: float, done: Done) -> None:
    """Sends VW ``vw``'s summed update of ``wave`` (sent at ``t``) to the PS shards; ``done(t_landed)``."""
    ...

  def pull(self, vw: int, t: float, done: Done) -> None:
    """Brings the global weights to VW ``vw`` (asked at ``t``); ``done(t_arrived)``."""
    ...

  def move(self, x: Any, src: StageId, dst: StageId) -> Any:
    """Moves ``x`` (an activation or a gradient) from stage ``src`` to stage ``dst``; returns it there."""
    ...


class StagedComm(Comm, Protocol):
  """A Comm that moves each stage's part of a push or pull on its own (``staged`` is True; the engine then
  calls these instead of ``push`` and ``pull``)."""

  def push_stage(self, key: Any, vw: int, stage: int, t: float) -> None:
    """Stage ``stage`` of VW ``vw`` has its part of push ``key`` (a wave) final at ``t``: it may leave."""
    ...

  def push_staged(self, key: Any, t: float, done: Done) -> None:
    """Push ``key`` is complete at ``t`` (every stage's part has left): ``done(t_landed)`` once all landed."""
    ...

  def pull_staged(self, vw: int, t: float, done: Callable[[int, float], None]) -> None:
    """Brings the global weights to VW ``vw``'s stages (asked at ``t``): ``done(stage, t_arrived)`` per
    stage."""
    ...


class InstantComm:
  """Pushes and pulls that take no time; tensors stay where they are."""

  staged = False  # a push or pull moves as one

  def push(self, vw: int, wave: int, t: float, done: Done) -> None:
    del vw, wave
    done(t)

  def pull(self, vw: int, t: float, done: Done) -> None:
    del vw
    done(t)

  def move(self, x: Any, src: StageId, dst: StageId) -> Any:
    del src, dst
    return x
