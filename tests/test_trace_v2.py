"""Trace version 2 (issue 42): tasks and pulls name their global base by ``seq`` (O(1) per event, where version 1
copies N clocks into each); the simulator writes either version, the two are the same run event for event once
written in version 1; the checker checks a trace as it is emitted (a Trace's sink), to the same verdict."""

import json
import subprocess
import sys

import numpy as np
import pytest

from hetpipe_jax import ConfigError, RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core import check
from hetpipe_jax.core.breakdown import time_breakdown
from hetpipe_jax.core.server import ClockServer, Snapshot
from hetpipe_jax.core.trace import Trace, read_trace, staleness_stats, write_trace
from hetpipe_jax.cost.profile import UnitProfile
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.run.executors import EXECUTORS
from hetpipe_jax.sim import SimJob, SimOptions, simulate
from hetpipe_jax.sim.simulate import simulate_fast
from hetpipe_jax.staleness import mean_staleness

from helpers import schedule_only, train_cli

GPU = GpuType("g", 1 << 34, 1e12, 1e12, 1e15, 1.0)
SLOW = GpuType("slow", 1 << 34, 0.5e12, 0.5e12, 1e15, 1.0)
PCIE, NET = Link("pcie", 1e10, 1e-6), Link("net", 1e9, 2e-6)


def _job(seed: int, waves: int = 8) -> SimJob:
  """A random layout of three VWs on six GPUs of two speeds, with staged PS transfers, failures and rejoins on
  odd seeds (a VW leaves and a replacement joins: the checker's seqs then become clocks)."""
  rng = np.random.default_rng(200 + seed)
  cluster = make_cluster("r", [[GPU, SLOW] for _ in range(3)], PCIE, NET)
  profiles = [UnitProfile(f"u{i}", float(rng.uniform(1e10, 1e11)), float(rng.uniform(2e10, 2e11)), 0, 0,
                          int(rng.integers(1e5, 3e8)), int(rng.integers(1e4, 1e7)), 0) for i in range(4)]
  vws = []
  for i in range(3):
    k = int(rng.choice([1, 2]))
    vws.append(VWLayout(tuple(cluster.gpus[2 * i:2 * i + k]), (0, 2, 4) if k == 2 else (0, 4),
                        int(rng.choice([1, 2, 3]))))
  failures = {1: [3], 2: [5]} if seed % 2 else {}
  return SimJob(cluster, profiles, Layout(tuple(vws)), int(rng.choice([0, 1, 3])), waves,
                str(rng.choice(["default", "local", "striped"])), failures=failures, rejoin=bool(failures),
                options=SimOptions(overlap_transfers=bool(seed % 3), staged_ps=seed % 4 < 2))


@pytest.mark.parametrize("seed", range(6))
def test_the_simulator_writes_both_versions_of_one_run(seed):
  traces = {}
  for version in (1, 2):
    trace = Trace(version=version)
    simulate(_job(seed), trace)
    traces[version] = trace.events
  v1, v2 = traces[1], traces[2]
  assert v2[0]["version"] == 2 and not any("glob" in e for e in v2)
  assert sum("seq" in e for e in v2) == sum("glob" in e for e in v1) > 0
  assert list(check.as_version_1(v2)) == v1
  assert check.check_trace(v2) == check.check_trace(v1) == []
  assert any(e["ev"] == "join" for e in v2) == bool(seed % 2)
  assert mean_staleness(v2) == mean_staleness(v1) and time_breakdown(v2) == time_breakdown(v1)  # tools read both


def test_a_version_2_trace_is_smaller_and_its_size_per_event_does_not_grow_with_the_virtual_workers():
  sizes = {}
  for n in (4, 32):
    for version in (1, 2):
      events = schedule_only([1] * n, [2] * n, d=0, waves=4, slowdown=[1.0 + k % 3 for k in range(n)],
                             version=version)
      sizes[n, version] = sum(len(json.dumps(e)) for e in events[1:]) / (len(events) - 1)
  assert sizes[32, 2] < 1.1 * sizes[4, 2]  # per event: the same few fields
  assert sizes[32, 1] > 1.5 * sizes[4, 1]  # version 1: N clocks in every task and pull


@pytest.mark.parametrize("seed", [0, 1])
def test_a_run_checked_as_it_is_emitted_gets_the_verdict_of_its_whole_trace(seed):
  """The fast mode simulates a scratch run, then keeps it or starts over: the sink that saw the kept run
  answers, as the checker of the kept events does."""
  kept, streamed = Trace(version=2), Trace(keep=False, version=2, sink=check.StreamCheck())
  info = [simulate_fast(_job(seed, waves=30), t)[3] for t in (kept, streamed)]
  assert info[0] == info[1] and not streamed.events
  assert streamed.sink.finish() == check.check_trace(kept.events) == []
  assert streamed.sink.seconds > 0


class _OpenGate(ClockServer):
  """A parameter server whose gate never closes (a planted fault)."""

  def try_pull(self, vw):
    return Snapshot(None, self.clock.c_local, self.clock.seq)


def test_a_fault_is_found_as_the_run_is_emitted(monkeypatch):
  monkeypatch.setattr(sys.modules["hetpipe_jax.sim.simulate"], "ClockServer", _OpenGate)
  cluster = make_cluster("two", [[GPU], [SLOW]], PCIE, NET)
  layout = Layout((VWLayout((cluster.gpus[0],), (0, 4), 1), VWLayout((cluster.gpus[1],), (0, 4), 1)))
  stream = check.StreamCheck()
  simulate(SimJob(cluster, _job(0).profiles, layout, 0, 6), Trace(keep=False, version=2, sink=stream))
  assert "gate" in {v.rule for v in stream.finish()}


def test_the_check_command_writes_a_version_2_trace_in_version_1(tmp_path):
  v2 = tmp_path / "v2.jsonl"
  trace = Trace(version=2)
  simulate(_job(1), trace)
  write_trace(str(v2), trace.events)
  out = tmp_path / "v1.jsonl"
  done = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(v2), f"--version_1={out}"],
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "OK" in done.stdout and "wrote" in done.stdout
  reference = Trace(version=1)
  simulate(_job(1), reference)
  assert [json.loads(line) for line in out.read_text().splitlines()] == json.loads(json.dumps(reference.events))
  bad = subprocess.run([sys.executable, "-m", "hetpipe_jax.check", str(v2), "--version1"], capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode == 2 and "--version1" in bad.stderr and "\n" not in bad.stderr.strip()


def test_a_trace_of_an_unknown_version_is_refused_in_one_line():
  events = schedule_only([1], [1], d=0, waves=2, slowdown=[1.0])
  events[0] = {**events[0], "version": 3}
  [violation] = check.check_trace(events)
  assert violation.line == 1 and "version 3" in violation.message and "reads versions 1, 2" in violation.message


# --- a run's trace version (RunConfig.trace_version, --trace_version) -----------------------------------------

@pytest.mark.parametrize("executor", ["virtual", "sim"])
def test_a_run_writes_version_2_as_the_same_run_in_version_1(executor, tmp_path):
  """The executors that write version 2 write the run version 1 writes (the trained weights and metrics too),
  its file in version 1 the other's event for event."""
  base = dict(cluster="hetero4", num_vws=2, stages=2, nm=2, d=1, waves=3, batch_size=16, executor=executor)
  runs = {v: run_hetpipe(get_model("mlp"), synthetic(num_train=256, num_test=32),
                         RunConfig.of(**base, trace_version=v, trace_path=str(tmp_path / f"v{v}.jsonl")))
          for v in (1, 2)}
  v1, v2 = runs[1].events, runs[2].events
  assert v2[0]["version"] == 2 and not any("glob" in e for e in v2) and any("seq" in e for e in v2)
  assert list(check.as_version_1(v2)) == v1 == read_trace(str(tmp_path / "v1.jsonl"))
  assert read_trace(str(tmp_path / "v2.jsonl")) == v2
  assert check.check_trace(v2) == [] and runs[1].metrics == runs[2].metrics
  assert staleness_stats(check.as_version_1(v2)) == staleness_stats(v1) and mean_staleness(v2) == mean_staleness(v1)


def test_a_trace_version_no_executor_writes_is_refused_in_one_line():
  with pytest.raises(ConfigError, match=r"^trace_version=3; the trace format has versions 1, 2$"):
    RunConfig.of(trace_version=3).validate()
  with pytest.raises(ConfigError, match=r"^trace_version=2 is not written by the multiprocess executor; use "
                                        r"trace_version=1$"):
    EXECUTORS["multiprocess"].validate(RunConfig.of(executor="multiprocess", trace_version=2))


@pytest.mark.slow  # (12 s: the fast suite's limit)
def test_the_training_cli_simulates_in_version_2_and_reports_what_version_1_reports(tmp_path):
  flags = ("--executor=sim", "--model=resnet152", "--cluster=paper_testbed", "--waves=4")
  for version in (1, 2):
    out = train_cli(tmp_path / f"v{version}", *flags, f"--trace_version={version}")
    assert out.returncode == 0 and "trace check: OK" in out.stdout, out.stderr[-2000:]
  summaries = [json.loads((tmp_path / f"v{v}" / "summary.json").read_text()) for v in (1, 2)]
  for summary in summaries:
    summary.pop("host_seconds")
  assert summaries[0] == summaries[1]
  v2 = read_trace(str(tmp_path / "v2" / "trace.jsonl"))
  assert v2[0]["version"] == 2 and list(check.as_version_1(v2)) == read_trace(str(tmp_path / "v1" / "trace.jsonl"))


def test_a_stream_checked_in_batches_finds_what_one_event_at_a_time_finds(monkeypatch):
  """A StreamCheck checks the events it holds together, ``_BATCH`` at a time: a faulty run split over many batches
  (of 7 events here) gets the violations, lines included, that checking its whole list gives, and the oracle's
  (the checker without shortcuts, on the trace in version 1)."""
  from test_checker_oracle import oracle
  monkeypatch.setattr(sys.modules["hetpipe_jax.sim.simulate"], "ClockServer", _OpenGate)
  cluster = make_cluster("two", [[GPU], [SLOW]], PCIE, NET)
  layout = Layout((VWLayout((cluster.gpus[0],), (0, 4), 1), VWLayout((cluster.gpus[1],), (0, 4), 1)))
  kept = Trace(version=2)
  simulate(SimJob(cluster, _job(0).profiles, layout, 0, 6), kept)
  whole = check.check_trace(kept.events)
  monkeypatch.setattr(check, "_BATCH", 7)
  stream = check.StreamCheck()
  for event in kept.events:
    stream(event)
  assert len(kept.events) > 10 * 7 and "gate" in {v.rule for v in whole}
  assert stream.finish() == whole == oracle(list(check.as_version_1(kept.events))) and stream.seconds > 0
