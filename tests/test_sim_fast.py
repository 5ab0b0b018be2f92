"""The sim executor's fast mode (hetpipe_jax.sim.steady): settled waves extrapolated, checked against the
full event simulation; the mixed scaling clusters."""

import json
import re
import subprocess
import sys

import pytest

from hetpipe_jax import RunConfig, get_cluster, run_hetpipe
from hetpipe_jax.cluster import SCALE_TYPES
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.profile import full_size_profiles
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.models import FULL_SIZE, full_size_model
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.sim import SimJob, simulate, simulate_fast
from hetpipe_jax.sim.steady import SteadyState

from helpers import assert_trace_ok


def test_steady_state_settles_on_a_periodic_run_and_extrapolates_exactly():
  steady = SteadyState(2, waves=50, rtol=1e-9)
  for w in range(5):  # VW 0: a wave every 1.0 s after a 3 s fill; VW 1: every 1.0 s, offset by 0.5
    assert not steady.settled()
    steady.push(0, 3.0 + w)
    steady.push(1, 3.5 + w)
  assert steady.settled() and steady.stopped_at == [5, 5] and steady.cycles == [1, 1]
  assert steady.ends() == [3.0 + 49, 3.5 + 49]
  assert steady.period() == 1.0 and steady.tail_waves() == 1


def test_steady_state_finds_a_cycle_of_wave_periods():
  steady = SteadyState(1, waves=50, rtol=1e-9)
  t, cycle = 0.0, [1.0, 1.5, 2.0]  # three waves that repeat
  for w in range(10):
    t += cycle[w % 3]
    steady.push(0, t)
    assert not steady.settled()  # 9 periods: three cycles, but the first period may still be the fill's
  t += cycle[10 % 3]
  steady.push(0, t)
  assert steady.settled() and steady.cycles == [3]
  assert steady.period() == 1.5 and steady.ends() == [t + 39 * 1.5]


def test_steady_state_does_not_settle_on_changing_periods():
  steady = SteadyState(1, waves=100, max_cycle=4, rtol=1e-3)
  t = 0.0
  for w in range(40):
    t += 1.0 + 0.01 * w  # slowing down: no cycle repeats
    steady.push(0, t)
    assert not steady.settled()
  with pytest.raises(ValueError, match="not settled"):
    steady.ends()


def test_steady_state_counts_the_tail_of_a_virtual_worker_that_runs_ahead():
  steady = SteadyState(2, waves=40, rtol=1e-9)
  for w in range(5):  # VW 1 pushes each wave 3.2 periods before VW 0: it ends 3.2 waves earlier
    steady.push(0, 10.0 + 2 * w)
    steady.push(1, 3.6 + 2 * w)
  assert steady.settled()
  assert steady.tail_waves() == 4 and steady.period() == 2.0


@pytest.mark.parametrize("model, policy, d, method", [
    ("vgg19", "HD", 0, "extrapolated"),
    ("resnet152", "ED", 4, "extrapolated"),
    ("vgg19", "NP", 4, "tail"),  # the fast node's VW runs D + 1 waves ahead and ends first
])
def test_fast_mode_matches_the_full_simulation(model, policy, d, method):
  cluster, profiles = get_cluster("paper_testbed"), full_size_profiles(model, 32)
  layout = plan_cluster(cluster, profiles, policy).layout
  full_trace, fast_trace = Trace(), Trace()
  seconds, _, _ = simulate(SimJob(cluster, profiles, layout, d, 60), full_trace)
  fast_seconds, vws, _, info = simulate_fast(SimJob(cluster, profiles, layout, d, 60), fast_trace)
  assert info["method"] == method
  assert max(info["simulated_waves"]) < 60
  assert [vw.total_mbs // vw.nm for vw in vws] == info["simulated_waves"]
  assert fast_seconds == pytest.approx(seconds, rel=0.005)
  assert_trace_ok(fast_trace.events)
  assert len(fast_trace.events) < len(full_trace.events)


def test_fast_mode_runs_in_full_when_the_tail_is_the_whole_run():
  cluster, profiles = get_cluster("paper_testbed"), full_size_profiles("vgg19", 32)
  layout = plan_cluster(cluster, profiles, "NP").layout
  trace = Trace()
  seconds, _, _ = simulate(SimJob(cluster, profiles, layout, 32, 40), Trace())
  fast_seconds, _, _, info = simulate_fast(SimJob(cluster, profiles, layout, 32, 40), trace)
  assert info == {"method": "full", "simulated_waves": [40] * 4}
  assert fast_seconds == seconds
  assert_trace_ok(trace.events)


def test_run_hetpipe_fast_sim_reports_the_whole_run():
  config = RunConfig.of(cluster="paper_testbed", policy="HD", d=0, waves=40, executor="sim", fast_sim=True)
  result = run_hetpipe(full_size_model("vgg19"), FULL_SIZE["vgg19"], config)
  full = run_hetpipe(full_size_model("vgg19"), FULL_SIZE["vgg19"], config.replace(fast_sim=False))
  assert result.fast_sim["method"] == "extrapolated"
  assert result.images == full.images
  assert result.images_per_second == pytest.approx(full.images_per_second, rel=0.005)
  assert_trace_ok(result.events)


@pytest.mark.parametrize("config, message", [
    (dict(executor="virtual", fast_sim=True), r"fast_sim is a model of the sim executor; the virtual executor "
                                              r"runs every wave: drop fast_sim or use executor=sim"),
    (dict(executor="sim", fast_sim=True, failures=((0, 2),)), r"an injected failure unsettles them"),
    (dict(executor="multiprocess", placement="striped"), r"placement=striped is not modelled by the multiprocess "
                                                         r"executor; use placement=default or local"),
])
def test_fast_sim_bad_configurations(config, message):
  with pytest.raises(ConfigError, match=message):
    run_hetpipe(full_size_model("vgg19"), FULL_SIZE["vgg19"],
                RunConfig.of(cluster="paper_testbed", policy="HD", **config))


def test_mixed_clusters_cycle_eight_types_in_nodes_of_four():
  cluster = get_cluster("mixed64")
  assert cluster.num_gpus == 64 and cluster.num_nodes == 16
  for node in range(16):
    assert {g.type.name for g in cluster.node_gpus(node)} == {SCALE_TYPES[node % 8]}
  big = get_cluster("mixed1024x8")
  assert big.num_nodes == 128 and {g.type.name for g in big.gpus} == set(SCALE_TYPES)
  with pytest.raises(ConfigError, match=re.escape("cluster mixed30: 30 GPUs in nodes of 4; use a positive "
                                                  "multiple of the GPUs per node")):
    get_cluster("mixed30")


def _run(args, cwd):
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_scale_study_and_its_validation(tmp_path):
  """The scaling study on clusters of single-GPU nodes of the 8 types (8 and 16 GPUs, the 16 replicating
  the 8's tuned configuration), then every configuration of it checked against the full simulation."""
  out = tmp_path / "scale"
  proc = _run(["experiments.scale", "--models=resnet152", "--sizes=8,16", "--per_node=1", "--base=8",
               "--waves=30", "--tune_waves=8", f"--out_dir={out}"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert re.fullmatch(r"plan_sim_seconds_16=\d+\.\d+ efficiency_16=\d\.\d{3}", last), last
  doc = json.loads((out / "scale.json").read_text())
  rows = doc["rows"]
  assert [r["gpus"] for r in rows] == [8, 16] and (out / "scale.png").exists() and (out / "scale.csv").exists()
  assert rows[1]["vws"] == 2 * rows[0]["vws"]  # replicated
  for key in ("nm", "window"):  # every virtual worker twice, alike ones in any order
    assert sorted(rows[1]["setting"][key]) == sorted(rows[0]["setting"][key] * 2)
  for r in rows:
    assert 0 < r["efficiency"] <= 1.0 + 1e-9 and r["items_per_sec"] == pytest.approx(
        r["efficiency"] * r["ideal_items_per_sec"])
  proc = _run(["experiments.validate_fast", f"--study={out / 'scale.json'}", "--waves=30",
               f"--out_dir={tmp_path / 'validate'}"], tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  checked = json.loads((tmp_path / "validate" / "validate_fast.json").read_text())["results"]
  assert len(checked) == 2 and all(abs(r["error"]) <= 0.02 for r in checked)
  assert proc.stdout.strip().splitlines()[-1].startswith("max_abs_error=")


@pytest.mark.parametrize("args, message", [
    (["experiments.scale", "--sizes=12,16"], r"--sizes=12,16: every size must be a positive multiple of "
                                             r"--per_node=8"),
    (["experiments.scale", "--models=vgg"], r"--models: 'vgg' is not a full-size model"),
    (["experiments.scale", "--ps_transfers="], r"--ps_transfers=; give whole, staged or both"),
    (["experiments.validate_fast", "--study=nowhere.json"], r"--study=nowhere.json does not exist; run "
                                                           r"`python -m experiments.scale` first"),
])
def test_scale_bad_flags(tmp_path, args, message):
  proc = _run(args, tmp_path)
  assert proc.returncode == 1
  assert re.match("error: " + message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-500:]
