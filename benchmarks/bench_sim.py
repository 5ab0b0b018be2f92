"""The simulator: VGG-19 on the paper's 16-GPU testbed (ED, Nm = 4, D = 0) on the sim executor."""

import workloads


def test_simulator(timed):
  timed(workloads.simulator, 300, rounds=3)
