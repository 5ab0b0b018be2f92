"""The trace checker on a recorded trace of 5,272 events (tests/golden/full_default.trace.jsonl.gz)."""

import workloads


def test_checker(timed):
  timed(workloads.checker, rounds=30)
