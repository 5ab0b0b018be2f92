"""The parameter server applying pushed waves (two virtual workers in turn, 8 shards of 257 KiB)."""

import workloads


def test_ps_push(timed):
  timed(workloads.ps_push, 40, rounds=30)
