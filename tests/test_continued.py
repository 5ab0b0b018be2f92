"""Checkpointed and --rejoin runs of the multiprocess executor in parts that continue one trace
(:mod:`hetpipe_jax.run.executors.continued`): where the parts end, and a part's trace written on the run's count."""


import pytest

from hetpipe_jax import RunConfig, check_trace, get_model, run_hetpipe, synthetic
from hetpipe_jax.run.executors.continued import boundaries, boundary_lines, continue_events

from helpers import TWO_NODES, train_cli

DATA = synthetic(num_train=256, num_test=64)


def test_parts_end_at_every_checkpoint_one_wave_after_each_failure_and_at_the_end():
  config = RunConfig.of(cluster="hetero4", num_vws=2, stages=2, waves=12, checkpoint_dir="/tmp/unused",
                        checkpoint_every=5, failures=[(1, 3), (0, 10)], rejoin=True)
  assert boundaries(config) == [4, 5, 10, 11, 12]
  assert boundaries(config.replace(rejoin=False)) == [5, 10, 12]
  plain = RunConfig.of(cluster="hetero4", num_vws=2, stages=2, waves=12, failures=[(1, 11)], rejoin=True)
  assert boundaries(plain) == [12]  # (a failure in the last wave: nothing to join)


def _two_parts(nm: int, d: int) -> tuple[list[dict], list[dict]]:
  """Two runs of 2 waves of 2 virtual workers (the second as a part that starts where the first ended)."""
  runs = [run_hetpipe(get_model("mlp"), DATA, RunConfig.of(cluster="hetero4", num_vws=2, stages=2, nm=nm, d=d,
                                                           waves=2, seed=seed)).events for seed in (0, 1)]
  return runs[0], runs[1]


@pytest.mark.parametrize("nm, d", [(2, 0), (3, 1)])
def test_a_part_written_on_the_runs_count_continues_a_trace_that_checks(nm, d):
  """A part's trace, its waves, minibatches, versions and clocks moved on by the 2 waves before it and its times
  after the first's, after every virtual worker's pull of the boundary's weights: one trace that every WSP rule
  accepts; without those pulls, its first forwards use weights no virtual worker pulled, and its first gated
  injection follows no pull."""
  first, second = _two_parts(nm, d)
  end = max(ev.get("t1", ev.get("t", 0.0)) for ev in first[1:])
  later = [dict(ev, **{f: ev[f] + end for f in ("t", "t0", "t1") if f in ev})
           for ev in continue_events(second, 2, [nm, nm])]
  assert [ev["mb"] for ev in later if ev["ev"] == "inject"][:2] == [2 * nm + 1, 2 * nm + 2]
  assert {tuple(ev["glob"]) for ev in later if ev["ev"] == "fwd" and ev["mb"] == 2 * nm + 1} == {(2, 2)}
  assert check_trace(first + boundary_lines(2, 2, (), end) + later) == []
  broken = check_trace(first + later)
  assert {v.rule for v in broken} == {"gate", "global"}, broken  # (a gated injection without a pull, too)
  assert any("which VW 0 never pulled" in v.message for v in broken), broken


def test_a_virtual_worker_that_left_joins_at_the_boundary_before_its_pull():
  lines = boundary_lines(4, 3, (1,), 2.5)
  assert [(ev["ev"], ev["vw"]) for ev in lines] == [("join", 1), ("pull", 0), ("pull", 1), ("pull", 2)]
  assert lines[0]["clock"] == 4 and all(ev["glob"] == [4, 4, 4] for ev in lines[1:])
  assert boundary_lines(0, 3, (), 0.0) == []  # the run's first part starts from the initial weights


@pytest.mark.parametrize("flags, message", [
    (("--checkpoint_dir=CK", "--ps_optimizer=delayed_nesterov"), "give --ps_optimizer=add, or drop the checkpoints"),
    (("--checkpoint_dir=CK", "--fail=0@2"), "give --rejoin with --fail, or drop the checkpoints"),
    (("--rejoin", "--adapt=on", "--time_scale=100"), "continues one trace over its parts: drop adapt"),
])
def test_a_run_in_parts_that_cannot_carry_something_is_one_line(tmp_path, flags, message):
  flags = tuple(f.replace("CK", str(tmp_path / "ck")) for f in flags)
  proc = train_cli(tmp_path, "--executor=multiprocess", "--dataset=synthetic", "--model=mlp", *flags,
                   f"--cluster={TWO_NODES}", "--num_vws=1", "--stages=2", "--waves=4", timeout=120)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
