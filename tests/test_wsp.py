"""The pure WSP clock/gate functions and the staleness bounds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe_jax.core import wsp


def test_clock_starts_at_zero_and_ticks_per_push():
  s = wsp.init(3)
  assert s.c_local == (0, 0, 0) and wsp.c_global(s) == 0
  s = wsp.push(wsp.push(s, 0), 0)
  assert s.c_local == (2, 0, 0)
  assert wsp.c_global(s) == 0
  assert wsp.clock_gap(s, 0) == 2 and wsp.clock_gap(s, 1) == 0
  s = wsp.push(wsp.push(s, 1), 2)
  assert wsp.c_global(s) == 1 and wsp.clock_gap(s, 0) == 1


def test_push_is_pure():
  s = wsp.init(2)
  t = wsp.push(s, 1)
  assert s.c_local == (0, 0) and t.c_local == (0, 1)


@pytest.mark.parametrize("d", [0, 1, 3])
def test_gate_opens_exactly_at_distance_d(d):
  s = wsp.init(2)
  for ahead in range(d + 3):
    assert wsp.gate_open(s, 0, d) == (ahead <= d)
    assert wsp.gate_open(s, 1, d)  # the slowest worker is never gated
    s = wsp.push(s, 0)


@pytest.mark.parametrize("nm", [1, 2, 4])
def test_waves_and_gated_injections(nm):
  mbs = range(1, 5 * nm + 1)
  assert [wsp.wave_of(p, nm) for p in mbs] == [(p - 1) // nm for p in mbs]
  assert [p for p in mbs if wsp.is_wave_end(p, nm)] == [nm * c for c in range(1, 6)]
  # The first injection after the push of wave c is minibatch (c+2)*Nm: the last of wave c+1.
  assert [p for p in mbs if wsp.is_gated(p, nm)] == [nm * c for c in range(2, 6)]


def test_min_global_waves_matches_hetpipe_section_3():
  nm, d = 3, 1
  # wave 4 = minibatches 13..15; non-last need waves 0..w-D-2 -> 2, the last needs w-D -> 3.
  assert [wsp.min_global_waves(p, nm, d) for p in (13, 14, 15)] == [2, 2, 3]
  assert wsp.min_global_waves(1, nm, d) == 0  # never negative


@pytest.mark.parametrize("nm,d,bound", [(1, 0, 0), (1, 3, 3), (2, 0, 2), (4, 1, 10), (3, 2, 10)])
def test_staleness_bounds(nm, d, bound):
  assert wsp.global_staleness_bound(nm, d) == bound
  assert wsp.local_staleness_bound(nm) == nm - 1
  # The bound is the largest p - 1 - Nm * min_global_waves(p) over a long run: it is tight.
  worst = max(p - 1 - nm * wsp.min_global_waves(p, nm, d) for p in range(nm * (d + 3), nm * (d + 9)))
  assert worst == bound


@settings(max_examples=200, deadline=None, derandomize=True)
@given(n=st.integers(1, 6), moves=st.lists(st.tuples(st.sampled_from(["push", "push", "push", "leave", "join"]),
                                                     st.integers(0, 5), st.none() | st.integers(0, 8)), max_size=60))
def test_the_global_clock_kept_as_clocks_change_is_the_minimum_of_the_clocks_that_count(n, moves):
  """``low`` and ``at_low``, kept by push, leave and join, are what the clocks give when counted afresh."""
  s = wsp.init(n)
  for move, vw, clock in moves:
    vw %= n
    s = wsp.push(s, vw) if move == "push" else wsp.leave(s, vw) if move == "leave" else wsp.join(s, vw, clock)
    counted = [c for i, c in enumerate(s.c_local) if i not in s.left] or list(s.c_local)
    assert (wsp.c_global(s), s.at_low) == (min(counted), counted.count(min(counted)))
    assert s == wsp.restore(s.c_local, s.left, s.seq)
  assert s.seq == sum(move != "leave" for move, _, _ in moves)  # every push and join changes the clocks


@settings(max_examples=100, deadline=None, derandomize=True)
@given(clocks=st.lists(st.integers(0, 9), max_size=3 * wsp.CHUNK + 5),
       sets=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 9)), max_size=12))
def test_clocks_read_as_the_tuple_of_their_clocks(clocks, sets):
  """``wsp.Clocks`` (persistent: a push copies one chunk) reads as a tuple would: index (negative too), slice,
  iterate, compare, hash, print, pickle; ``set`` leaves the clocks it came from as they were."""
  import pickle

  c, t = wsp.Clocks(clocks), tuple(clocks)
  for i, clock in sets:
    if t:
      i %= len(t)
      before = c
      c, t = c.set(i, clock), t[:i] + (clock,) + t[i + 1:]
      assert before == tuple(before) and (before == c) == (tuple(before) == t)
  assert len(c) == len(t) and list(c) == list(t) and c == t and c == wsp.Clocks(t) and hash(c) == hash(t)
  assert [c[i] for i in range(-len(t), len(t))] == [t[i] for i in range(-len(t), len(t))]
  assert c[1:-1:2] == t[1:-1:2] and repr(c) == repr(t) and pickle.loads(pickle.dumps(c)) == c
  assert c != list(t)  # (as a tuple: never equal to a list)
  for bad in (len(t), -len(t) - 1):
    with pytest.raises(IndexError):
      c[bad]


def test_a_push_shares_every_chunk_of_clocks_but_the_pushers():
  """A push at 1,000 VWs copies one chunk of ``CHUNK`` clocks (and the tuple of chunks), not the 1,000 clocks."""
  s = wsp.init(1000)
  t = wsp.push(s, 700)
  shared = [a is b for a, b in zip(s.c_local._chunks, t.c_local._chunks)]
  assert shared.count(False) == 1 and not shared[700 // wsp.CHUNK]
  assert t.c_local[700] == 1 and sum(t.c_local) == 1 and sum(s.c_local) == 0
