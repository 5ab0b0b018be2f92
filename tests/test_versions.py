"""Weight-version bookkeeping as pure functions: stash vs latest, wave closing, rebase on pull."""

import pytest

from hetpipe_jax.core import versions
from hetpipe_jax.core.versions import Version
from hetpipe_jax.errors import ProtocolError


def test_stash_backward_uses_its_forwards_version_latest_the_current_one():
  for mode, want in (("stash", Version(0, (0, 0))), ("latest", Version(1, (0, 0)))):
    book = versions.init(k=1, num_vws=2)
    book, v1 = versions.forward(book, 0, 1)
    book, v2 = versions.forward(book, 0, 2)
    assert v1 == v2 == Version(0, (0, 0))
    book, used1 = versions.backward(book, 0, 1, nm=2, weight_mode=mode)
    book, used2 = versions.backward(book, 0, 2, nm=2, weight_mode=mode)
    assert used1 == Version(0, (0, 0)) and used2 == want
    assert book.current[0].own == 2 and versions.open_updates(book) == [2]


def test_close_wave_needs_nm_updates_on_every_stage():
  book = versions.init(k=2, num_vws=1)
  for j in (1, 0):
    book, _ = versions.forward(book, j, 1)
    book, _ = versions.backward(book, j, 1, nm=1, weight_mode="stash")
  closed = versions.close_wave(book, 0, nm=1, vw=0)
  assert versions.open_updates(closed) == [0, 0]
  with pytest.raises(ProtocolError, match="wave 0 has 1 updates, expected Nm=2"):
    versions.close_wave(book, 0, nm=2, vw=0)


def test_rebase_counts_pushed_waves_and_added_local_updates():
  book = versions.init(k=2, num_vws=3)
  book = versions.rebase(book, waves=(2, 1, 4), vw=0, nm=3, added=[1, 0])
  assert book.current == (Version(7, (2, 1, 4)), Version(6, (2, 1, 4)))


def test_each_stage_closing_its_part_is_closing_the_wave():
  """A decentralised stage closes its own part of a wave (after its last backward of it): stage by stage it
  is what closing the wave at once is, and it refuses a part without Nm updates."""
  book = versions.init(k=2, num_vws=1)
  for mb in (1, 2):
    for j in (1, 0):
      book, _ = versions.forward(book, j, mb)
      book, _ = versions.backward(book, j, mb, nm=2, weight_mode="stash")
  staged = versions.close_stage_wave(versions.close_stage_wave(book, 1, 0, nm=2, vw=0), 0, 0, nm=2, vw=0)
  assert staged == versions.close_wave(book, 0, nm=2, vw=0)
  with pytest.raises(ProtocolError, match="VW 0 stage 1: wave 0 has 2 updates, expected Nm=3"):
    versions.close_stage_wave(book, 1, 0, nm=3, vw=0)
