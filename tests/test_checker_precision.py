"""The checker's rule on skipped updates, per precision (docs/PROTOCOL.md sections 3.10 and 9): only fp16 scales
the loss, so only an fp16 run may push a wave with skipped updates; bf16 (fp32's exponent range) and fp32
never do, and a bf16 trace that says so is a violation."""

import pytest

from hetpipe_jax import check_trace

from helpers import schedule_only

STAGES, NM = [2, 3], [2, 1]


def trace_with_skipped(precision: str | None, skipped: int) -> list[dict]:
  """A sound trace (2 VWs of 2 and 3 stages) at ``precision`` (None: a meta line without it, read as fp32)
  whose VW 0 says ``skipped`` of wave 1's updates were skipped."""
  events = schedule_only(STAGES, NM, d=1, waves=3, slowdown=(1, 2))
  if precision is not None:
    events[0]["precision"] = precision
  push = next(ev for ev in events if ev["ev"] == "push" and ev["vw"] == 0 and ev["wave"] == 1)
  push["skipped"] = skipped
  return events


@pytest.mark.parametrize("precision", ["bf16", "fp32", None])
def test_skipped_updates_outside_fp16_are_a_violation(precision):
  violations = check_trace(trace_with_skipped(precision, 1))
  assert [v.rule for v in violations] == ["push"], f"a {precision} push that skipped 1 update: {violations}"
  assert f"only an fp16 run skips (this is {precision or 'fp32'})" in str(violations[0])


def test_fp16_may_skip_up_to_stages_times_nm_per_wave():
  most = STAGES[0] * NM[0]
  for skipped in (1, most):
    assert check_trace(trace_with_skipped("fp16", skipped)) == []
  for skipped in (0, most + 1):  # (a push that skipped none says nothing)
    violations = check_trace(trace_with_skipped("fp16", skipped))
    assert [v.rule for v in violations] == ["push"] and f"1 to stages x Nm = {most} per wave" in str(violations[0])
