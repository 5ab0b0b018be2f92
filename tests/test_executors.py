"""Executor mechanics: a failure inside a task stops the run with that error instead of hanging."""

import threading

import pytest

from hetpipe_jax.core.engine import Engine

from helpers import schedule_only


class FailingEngine(Engine):
  """Raises in the 10th task it finishes."""

  finished = 0

  def finish(self, task, t):
    FailingEngine.finished += 1
    if FailingEngine.finished == 10:
      raise RuntimeError("boom in task")
    super().finish(task, t)


@pytest.mark.parametrize("executor", ["virtual", "wall"])
def test_task_failure_propagates(executor):
  FailingEngine.finished = 0
  outcome = []

  def run():
    try:
      schedule_only([2, 2], [2, 2], d=0, waves=6, slowdown=(1, 2), executor=executor,
                    engine_class=FailingEngine)
      outcome.append(None)
    except RuntimeError as e:
      outcome.append(e)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(60)
  assert not thread.is_alive(), "the executor hung after a task failed"
  assert outcome and "boom in task" in str(outcome[0])
