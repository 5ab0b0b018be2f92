"""Staleness controls: which weights a minibatch's passes use inside a virtual worker, and when its update lands.

HetPipe's pipeline keeps up to Nm minibatches in flight, and each updates weights that its forward did not see
(local staleness up to Nm - 1, docs/PROTOCOL.md section 3.7). A *staleness control* is one rule among a small
table, as the parameter server's rules are (:mod:`hetpipe_jax.optim`): each declares its memory charge (the
planner and the simulator read it), its state (checkpoints and the numeric oracle carry it) and the local
staleness it allows (the checker checks it). The runtime computes it (:mod:`hetpipe_jax.runtime.numerics.stage`);
nothing here touches an array::

  control = parse_control("2bw:k=4")
  control.accumulate(nm=8)           # 4 minibatches per local update
  control.stashed_versions(8)        # 3 weight versions a stage holds for its 8 forwards in flight

The controls (``--staleness``):

``per_minibatch`` (default; the paper's, PipeDream's weight stashing)
  Every minibatch's backward turns its gradient into one local update, applied at once; with ``stash`` its
  backward uses its forward's weights. Local staleness <= Nm - 1 minibatch updates; one stashed weight version per
  minibatch in flight.

``2bw:k=K`` (PipeDream-2BW, Narayanan et al., "Memory-efficient pipeline-parallel DNN training", ICML 2021,
section 3.1; PACI's local gradient accumulation as version control)
  A stage sums the gradients of K consecutive minibatches (K divides Nm; ``k=0``: K = the virtual worker's Nm) and
  applies one local update of their mean when the K-th backward runs: each forward sees every group of K whose
  last minibatch completed before it entered, so with K >= the window a minibatch misses at most the one update
  of its predecessor group (2BW's constant delay of one update, whatever the depth). Own updates in a forward of
  p: at least K x floor((p - Nm) / K). Memory: the weight versions in flight are at most ceil(W / K) + 1 (2 when
  K >= W; W the window), not W, plus one fp32 gradient accumulator.

``predict`` (PipeOptim, Guan et al., arXiv 2312.00839, eq. 9; SpecTrain, Chen et al., arXiv 1809.02839, for
momentum)
  The forward of p at a stage runs on the weights the local optimizer's rule predicts for when p's backward
  lands there: w + s x u, where u is the stage's last local update (the optimizer's own step: Adam's
  -lr m/(sqrt(v) + eps), momentum's -lr v, SGD's -lr g) and s the stage's forwards in flight before p (the local
  updates the stage will apply before p's backward). The backward uses those weights in ``stash`` mode. The
  versions and every guarantee are those of ``per_minibatch`` (a prediction is no update); memory adds one fp32
  copy (u).

``pipemare:warmup=T`` (PipeMare, Yang et al., "Asynchronous pipeline parallel DNN training", MLSys 2021, section
3.1, technique T1)
  A per-minibatch update whose size is scaled by tau^-(1 - min(t / T, 1)), tau = max(1, s) the update's delay in
  the stage's local updates (s as above) and t the stage's local updates so far: a delayed stage's rate warms up
  from lr / tau to lr over T local updates. Versions, guarantees and memory those of ``per_minibatch``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hetpipe_jax.errors import ConfigError

# name -> its knobs and their defaults
CONTROLS: dict[str, dict[str, int]] = {
    "per_minibatch": {},
    "2bw": {"k": 0},
    "predict": {},
    "pipemare": {"warmup": 100},
}
DEFAULT = "per_minibatch"


class Control(NamedTuple):
  """A parsed staleness control (:data:`CONTROLS`): its name and knobs.

  Attributes:
    name: a key of :data:`CONTROLS`.
    k: ``2bw``'s minibatches per local update (0: the virtual worker's Nm); 1 for the others.
    warmup: ``pipemare``'s local updates over which a delayed stage's rate warms up.
  """

  name: str = DEFAULT
  k: int = 1
  warmup: int = 0

  def __str__(self) -> str:
    """The canonical spec (what the trace's meta line records): ``per_minibatch``, ``2bw:k=4``, ..."""
    keys = CONTROLS[self.name]
    return self.name + (":" + ",".join(f"{key}={getattr(self, key)}" for key in keys) if keys else "")

  @property
  def predicts(self) -> bool:
    return self.name == "predict"

  @property
  def delay_scaled(self) -> bool:
    return self.name == "pipemare"

  def accumulate(self, nm: int) -> int:
    """Minibatches per local update for a virtual worker of waves of ``nm`` (1 but under ``2bw``)."""
    if self.name != "2bw":
      return 1
    return nm if self.k == 0 else self.k

  def stashed_versions(self, window: int) -> int:
    """Weight versions a stage in ``stash`` mode holds for its forwards in flight (``window`` of them at most):
    one per minibatch, or under ``2bw`` the groups that many minibatches can span, ceil(W / k) + 1 (2 with
    ``k=0``: k = Nm >= W)."""
    if self.name != "2bw" or self.k == 1:
      return window
    return min(window, 2 if self.k == 0 else math.ceil(window / self.k) + 1)

  @property
  def extra_copies(self) -> int:
    """fp32 parameter-sized arrays the control keeps beside the weights (a gradient sum, a last update)."""
    return 1 if self.name in ("2bw", "predict") else 0

  def check_nm(self, nms: list[int]) -> None:
    """Raises ConfigError where a virtual worker's wave is not whole groups of the control's K."""
    for i, nm in enumerate(nms):
      k = self.accumulate(nm)
      if nm % k:
        raise ConfigError(f"staleness={self}: virtual worker {i} has Nm={nm}, which k={k} does not divide (a wave "
                          f"must hold whole groups of k minibatches); use k=0 (k = Nm) or a divisor of every Nm")


PER_MINIBATCH = Control()  # the default control: one local update per minibatch (the paper's)


def min_own(p: int, nm: int, k: int) -> int:
  """The fewest own minibatch updates a forward of minibatch ``p`` may include (docs/PROTOCOL.md section 3.7,
  rule 1): ``p - Nm`` with one update per minibatch, ``K x floor((p - Nm) / K)`` with one per K."""
  return p - nm if k == 1 else (p - nm) // k * k


def updates_at(mb: int, k: int) -> int:
  """Own minibatch updates a stage's backward of ``mb`` applies: 1, or under accumulation over ``k`` minibatches
  ``k`` at a group's last minibatch and 0 before it."""
  return 1 if k == 1 else (k if mb % k == 0 else 0)


def delay_scale(delay: int, steps: int, warmup: int) -> float:
  """PipeMare's T1 factor on an update of delay ``delay`` after ``steps`` local updates (module docstring)."""
  tau = max(1, delay)
  return tau ** -(1.0 - min(steps / warmup, 1.0)) if warmup > 0 else 1.0


def parse_control(spec: str) -> Control:
  """Parses ``NAME[:KEY=VALUE,...]``: ``per_minibatch``, ``2bw``, ``2bw:k=4``, ``predict``, ``pipemare:warmup=200``.

  Raises:
    ConfigError: for an unknown name or key, or a value that is not a whole number in range.
  """
  name, _, rest = str(spec).strip().partition(":")
  if name not in CONTROLS:
    raise ConfigError(f"staleness={spec!r}: unknown control {name!r}; choose one of {', '.join(CONTROLS)} "
                      "(e.g. 2bw:k=4)")
  knobs, given = dict(CONTROLS[name]), set()
  for item in filter(None, (part.strip() for part in rest.split(","))):
    key, eq, value = item.partition("=")
    if key not in knobs or not eq:
      allowed = ", ".join(knobs) or "none"
      raise ConfigError(f"staleness={spec!r}: {name} takes the keys {allowed}, as KEY=VALUE; got {item!r}")
    if key in given:
      raise ConfigError(f"staleness={spec!r}: {key} is given twice; give each key once")
    given.add(key)
    try:
      knobs[key] = int(value)
    except ValueError:
      raise ConfigError(f"staleness={spec!r}: {key}={value!r} is not a whole number") from None
    if knobs[key] < 0:
      raise ConfigError(f"staleness={spec!r}: {key}={knobs[key]} must be >= 0")
  if name == "pipemare" and knobs["warmup"] < 1:
    raise ConfigError(f"staleness={spec!r}: warmup must be >= 1 local update")
  return Control(name, knobs.get("k", 1), knobs.get("warmup", 0))
