"""Golden schedules: literal per-device task orders of one virtual worker, fwd = 1 and bwd = 1 time unit.

Hand-derived for k = 2, Nm = 2 (1F1B)::

  t      0    1    2    3    4    5    6    7   ...
  dev0   F1   F2   .    B1   F3   B2   F4   B3  ...   mb 3 waits for mb 1 to complete (Nm window)
  dev1   .    F1   B1   F2   B2   F3   B3   F4  ...   backward first once B1 is ready at t = 2
"""

import pytest

from helpers import assert_trace_ok, schedule_only


def device_orders(events, k):
  return {j: " ".join(("F" if e["ev"] == "fwd" else "B") + str(e["mb"]) for e in events
                      if e["ev"] in ("fwd", "bwd") and e["stage"] == j) for j in range(k)}


GOLDEN = [
    # (k, Nm, waves, schedule, bwd time): {stage: order}
    ((2, 1, 3, "1f1b", 1.0), {0: "F1 B1 F2 B2 F3 B3", 1: "F1 B1 F2 B2 F3 B3"}),
    ((2, 2, 3, "1f1b", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 2, 3, "1f1b", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 F2 B1 B2 F3 F4 B3 B4 F5 F6 B5 B6",
                              2: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((4, 4, 2, "1f1b", 1.0), {0: "F1 F2 F3 F4 B1 F5 B2 F6 B3 F7 B4 F8 B5 B6 B7 B8",
                              1: "F1 F2 F3 F4 B1 B2 F5 B3 F6 B4 F7 B5 F8 B6 B7 B8",
                              2: "F1 F2 F3 B1 F4 B2 B3 F5 B4 F6 B5 F7 B6 F8 B7 B8",
                              3: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8"}),
    ((2, 2, 3, "fifo", 1.0), {0: "F1 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 B6",
                              1: "F1 F2 B1 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 3, 2, "1f1b", 2.0), {0: "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6",
                              1: "F1 F2 F3 B1 B2 F4 B3 F5 B4 F6 B5 B6",
                              2: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6"}),
    ((3, 3, 2, "fifo", 2.0), {0: "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 B5 B6",
                              1: "F1 F2 F3 B1 B2 B3 F4 F5 F6 B4 B5 B6",
                              2: "F1 F2 B1 F3 B2 B3 F4 F5 B4 B5 F6 B6"}),
]


@pytest.mark.parametrize("case,expected", GOLDEN, ids=[str(c) for c, _ in GOLDEN])
def test_golden_schedule(case, expected):
  k, nm, waves, schedule, bwd = case
  events = schedule_only([k], [nm], d=0, waves=waves, slowdown=[1.0], schedule=schedule, bwd=bwd)
  assert_trace_ok(events)
  assert device_orders(events, k) == expected


@pytest.mark.parametrize("k,nm", [(2, 2), (4, 4), (4, 2), (3, 5)])
def test_schedule_invariants(k, nm):
  """Never more than Nm minibatches in flight; injection and completion in order; every task once."""
  events = schedule_only([k], [nm], d=0, waves=4, slowdown=[1.0], bwd=2.0)
  assert_trace_ok(events)
  in_flight, peak = 0, 0
  for e in events:
    in_flight += {"inject": 1, "complete": -1}.get(e["ev"], 0)
    peak = max(peak, in_flight)
  assert peak == min(nm, 4 * nm)
  assert [e["mb"] for e in events if e["ev"] == "complete"] == list(range(1, 4 * nm + 1))
  assert sum(e["ev"] in ("fwd", "bwd") for e in events) == 2 * k * 4 * nm
