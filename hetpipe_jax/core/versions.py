"""Weight versions: which updates the weights of each stage of a virtual worker contain.

A version is ``(own, glob, seq)``: ``own`` counts the virtual worker's own minibatch updates in the weights,
``glob[k]`` the waves of virtual worker k in their global base, ``seq`` its place in the PS's order of clock
changes (docs/PROTOCOL.md sections 3.6 and 8). The trace reports
the version every task used and the checker verifies it, with or without numerics. Functions on a NamedTuple,
like :mod:`hetpipe_jax.core.wsp`, that return the new book; all but two are pure. :func:`forward` and
:func:`backward` (one call per task) update the book's ``forwards`` and the stage's open counts in place, as the
engine's state changes its containers: their caller replaces its book with the one returned and keeps no older
one. (Copying those dicts per task was a sixth of the simulator's cache misses at scale: each copy touches every
entry, read cold.)

* a forward uses the stage's current version;
* a backward uses its forward's version in ``stash`` mode, the current one in ``latest`` mode, and its
  update is applied at once: ``own`` grows by one and the update joins its wave's open count (accumulated over k
  minibatches, :mod:`hetpipe_jax.core.controls`: by k at a group's last backward, by none before it);
* a push closes a wave (every stage must hold exactly Nm of its updates);
* a pull rebases every stage: ``own`` = the VW's pushed waves x Nm + the local updates added back on top
  (a staged pull rebases each stage when its part lands: :func:`rebase_stage`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from hetpipe_jax.core import wsp
from hetpipe_jax.core.controls import updates_at
from hetpipe_jax.errors import ProtocolError

WEIGHT_MODES = ("stash", "latest")


class Version(NamedTuple):
  """Which updates a set of stage weights contains."""

  own: int  # own minibatch updates
  glob: Sequence[int]  # waves of each virtual worker in the global base
  seq: int = 0  # the global base's place in the PS's order of clock changes (what a trace of version 2 records)


class VersionBook(NamedTuple):
  """The versions of one virtual worker's stages.

  Attributes:
    current: per stage, the version of the weights it holds now.
    open_waves: per stage, wave -> local updates applied and not pushed yet.
    forwards: (stage, minibatch) -> the version a forward used, until its backward.
  """

  current: tuple[Version, ...]
  open_waves: tuple[dict[int, int], ...]
  forwards: dict[tuple[int, int], Version]


def init(k: int, num_vws: int) -> VersionBook:
  """``k`` stages holding the initial weights: no own update, no wave of anyone."""
  return VersionBook((_initial(num_vws),) * k, tuple({} for _ in range(k)), {})


@functools.lru_cache(maxsize=4)
def _initial(num_vws: int) -> Version:
  """The initial version of ``num_vws`` virtual workers, one for all of them: each holding its own N zeros was
  O(N^2) memory (512 MB at 8,192 virtual workers)."""
  return Version(0, (0,) * num_vws, 0)


_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (once per task: it adds up)


def forward(book: VersionBook, stage: int, mb: int) -> tuple[VersionBook, Version]:
  """A forward of ``mb`` starts at ``stage``: it uses the current version (kept for its backward; ``book``'s
  ``forwards`` changes in place: the module's note)."""
  version = book.current[stage]
  book.forwards[(stage, mb)] = version
  return book, version


def backward(book: VersionBook, stage: int, mb: int, nm: int, weight_mode: str, k: int = 1
             ) -> tuple[VersionBook, Version]:
  """A backward of ``mb`` starts at ``stage`` and applies its update; returns the version it used (``book``'s
  ``forwards`` and the stage's open counts change in place: the module's note). With accumulation over ``k``
  minibatches (:mod:`hetpipe_jax.core.controls`, ``2bw``) the update of a group of ``k`` is applied at its last
  minibatch's backward, as ``k`` minibatch updates; the others apply none."""
  current, open_waves, forwards = book
  fwd_version = forwards.pop((stage, mb))
  now = current[stage]
  used = fwd_version if weight_mode == "stash" else now
  if k == 1:
    applied = 1
  else:
    applied = updates_at(mb, k)
    if not applied:
      return book, used
  wave = wsp.wave_of(mb, nm)
  opened = open_waves[stage]
  opened[wave] = opened.get(wave, 0) + applied
  current = current[:stage] + (_tuple(Version, (now[0] + applied, now[1], now[2])),) + current[stage + 1:]
  return _tuple(VersionBook, (current, open_waves, forwards)), used


def close_wave(book: VersionBook, wave: int, nm: int, vw: int) -> VersionBook:
  """A finished wave leaves the open counts (it is being pushed).

  Raises:
    ProtocolError: when a stage does not hold exactly Nm updates of the wave.
  """
  open_waves = []
  for j, opened in enumerate(book.open_waves):
    opened = dict(opened)
    count = opened.pop(wave, 0)
    if count != nm:
      raise ProtocolError(f"VW {vw} stage {j}: wave {wave} has {count} updates, expected Nm={nm}")
    open_waves.append(opened)
  return book._replace(open_waves=tuple(open_waves))


def close_stage_wave(book: VersionBook, stage: int, wave: int, nm: int, vw: int) -> VersionBook:
  """:func:`close_wave` at one stage (a decentralised run: each stage closes its part after its own last
  backward of the wave).

  Raises:
    ProtocolError: when the stage does not hold exactly Nm updates of the wave.
  """
  opened = dict(book.open_waves[stage])
  count = opened.pop(wave, 0)
  if count != nm:
    raise ProtocolError(f"VW {vw} stage {stage}: wave {wave} has {count} updates, expected Nm={nm}")
  return book._replace(open_waves=_set(book.open_waves, stage, opened))


def open_updates(book: VersionBook) -> list[int]:
  """Per stage, the local updates not pushed yet (what a rebase adds back on top of the global base)."""
  return [sum(opened.values()) for opened in book.open_waves]


def rebase(book: VersionBook, waves: Sequence[int], vw: int, nm: int, added: Sequence[int],
           seq: int = 0) -> VersionBook:
  """A pull of global weights containing ``waves``; ``added[j]`` = local updates stage j added back.

  With numerics, ``added`` is what the stages really added (so a rebase that loses updates shows in the
  trace); without, :func:`open_updates`.
  """
  glob = _frozen(waves)
  return book._replace(current=tuple(Version(glob[vw] * nm + a, glob, seq) for a in added))


def rebase_stage(book: VersionBook, stage: int, waves: Sequence[int], vw: int, nm: int, added: int,
                 seq: int = 0) -> VersionBook:
  """:func:`rebase` of one stage (a staged pull: each stage's part lands on its own)."""
  glob = _frozen(waves)
  return book._replace(current=_set(book.current, stage, Version(glob[vw] * nm + added, glob, seq)))


def _frozen(waves: Sequence[int]) -> Sequence[int]:
  """``waves`` as an immutable sequence: the PS's clocks as they are (a pull copies no N-entry vector)."""
  return waves if isinstance(waves, (tuple, wsp.Clocks)) else tuple(waves)


def _set(values: tuple, index: int, value) -> tuple:
  return values[:index] + (value,) + values[index + 1:]
