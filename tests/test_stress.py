"""Under load (issue 10): many virtual workers pushing and pulling concurrently for thousands of waves,
on real threads (wall) and real processes (multiprocess): no update lost or double-counted (the
checker's accounting: every task's weights hold exactly the updates its stage applied, every wave is
pushed once), no deadlock (a timeout)."""


import pytest

from hetpipe_jax import RunConfig, get_model, read_trace, run_hetpipe, synthetic

from helpers import TWO_NODES, assert_trace_ok, train_cli


@pytest.mark.slow
@pytest.mark.parametrize("d", [0, 2])
def test_eight_virtual_workers_on_threads_for_a_thousand_waves(d):
  result = run_hetpipe(get_model("mlp"), synthetic(num_train=256), RunConfig.of(
      cluster="uniform8", num_vws=8, stages=1, nm=1, d=d, waves=1000, batch_size=16, executor="wall",
      eval_every=1000))
  assert_trace_ok(result.events)
  pushes = [e for e in result.events if e["ev"] == "push"]
  assert len(pushes) == 8 * 1000
  assert sum(e["ev"] == "pull" for e in result.events) >= 8 * (1000 - 1) // (d + 1)


@pytest.mark.slow
def test_two_processes_for_a_thousand_waves_each(tmp_path):
  proc = train_cli(tmp_path, "--executor=multiprocess", f"--cluster={TWO_NODES}", "--model=mlp", "--dataset=synthetic",
                   "--num_vws=2", "--stages=1", "--nm=2", "--d=0", "--waves=1000", "--eval_every=1000", timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = read_trace(str(tmp_path / "trace.jsonl"))
  assert_trace_ok(events)
  assert sum(e["ev"] == "push" for e in events) == 2 * 1000
