"""The engine's step: the protocol without numerics on the virtual clock, and the wall executor's host
overhead per task against the same stage programs called back to back (CPU emulation)."""

import workloads

WAVES = 100  # 3,200 stage tasks of the tiny 4-stage MLP (Nm = 4), as experiments/bench_overhead.py


def test_engine_virtual(timed):
  timed(workloads.engine_virtual, 400, rounds=5)


def test_wall_executor(timed):
  timed(workloads.wall_executor, WAVES, rounds=7)


def test_wall_stage_programs(timed):
  timed(workloads.wall_stage_programs, WAVES, rounds=7)
