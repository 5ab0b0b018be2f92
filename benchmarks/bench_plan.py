"""The partitioner on ResNet-152's full-size profile (experiments/bench_plan.py's cases)."""

import pytest
import workloads


@pytest.mark.parametrize(("cluster", "rounds"), [("paper_mini", 20), ("paper_half", 3)],  # 4 GPUs, 8 GPUs
                         ids=["paper_mini", "paper_half"])
def test_plan_vw(timed, cluster, rounds):
  timed(workloads.plan_vw, cluster, rounds=rounds)


def test_partition_16gpu(timed):
  timed(workloads.partition_16gpu, rounds=5)
