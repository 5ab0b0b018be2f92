"""The simulators' variance model (issue 39, item 1): its spec, its seeded realisation (the same for every system),
and its effect on the simulators, worked by hand."""

import json

import numpy as np
import pytest

from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.baselines.sync import SyncJob, Worker, simulate_sync
from hetpipe_jax.cluster import GpuType, Link, make_cluster
from hetpipe_jax.core.trace import Trace
from hetpipe_jax.cost.batch import fixed
from hetpipe_jax.cost.unit import UnitProfile
from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.layout import Layout, VWLayout
from hetpipe_jax.sim import SimJob, SimOptions, simulate
from hetpipe_jax.sim.network import Simulator
from hetpipe_jax.sim.noise import DEFAULT, NONE, Episodes, Event, NoiseSpec, Realisation, parse_noise
from hetpipe_jax.systems.registry import get_system
from hetpipe_jax.tune import SearchSpace

from helpers import assert_trace_ok

GPU = GpuType("g", 1 << 34, 1e12, 1e12, 1e15, 1.0)
LINK = Link("l", 1e12, 0.0)  # (transfers of a few bytes take nothing)
CLUSTER = make_cluster("four", [[GPU, GPU], [GPU, GPU]], LINK, LINK)
UNITS = [UnitProfile(f"u{i}", 1e11, 2e11, 0, 0, 8, 8, 0) for i in range(2)]  # 0.1 s forward, 0.2 s backward


def test_a_spec_is_none_default_a_multiple_of_it_keys_or_a_file(tmp_path):
  assert parse_noise("none") == NONE and NONE.quiet and parse_noise("default") == DEFAULT
  assert parse_noise("default,seed=2") == DEFAULT._replace(seed=2)
  assert parse_noise("default*2,seed=1,jitter=0.1") == DEFAULT.scaled(2)._replace(seed=1, jitter=0.1)
  with pytest.raises(ConfigError, match="noise='defaults'"):
    parse_noise("defaults,seed=1")
  twice = parse_noise("default*2")
  assert (twice.jitter, twice.card, twice.episodes.rate_per_hour, twice.slow_cards) == (0.04, 0.04, 0.002, 0.01)
  assert twice.episodes.mean_s == DEFAULT.episodes.mean_s and twice.episodes.factor == DEFAULT.episodes.factor
  spec = parse_noise("jitter=0.1,gpu=2/30/0.5,slow=0.25/0.9,persist=1@5:0.5;3@0:0.25,seed=7")
  assert spec == NoiseSpec(0.1, 0.0, Episodes(2.0, 30.0, 0.5), 0.25, 0.9, ((1, 5.0, 0.5), (3, 0.0, 0.25)), 7)
  path = tmp_path / "noise.json"
  path.write_text(json.dumps({"jitter": 0.1, "persist": "1@5:0.5;3@0:0.25"}))
  assert parse_noise(str(path)) == NoiseSpec(0.1, persistent=((1, 5.0, 0.5), (3, 0.0, 0.25)))


@pytest.mark.parametrize("text, message", [
    ("jiter=0.1", r"'jiter=0.1' is not KEY=VALUE with KEY one of jitter, card"),
    ("jitter=-1", r"jitter='-1'; give a finite number >= 0"),
    ("gpu=1/2", r"gpu='1/2' has 2 parts; give 3 separated by '/'"),
    ("gpu=1/60/1.5", r"gpu factor='1.5'; give the fraction of its speed a GPU keeps, in \(0, 1\]"),
    ("persist=3:0.5", r"persist='3:0.5'; give GPU@SECONDS:FACTOR"),
    ("default*x", r"default\*x='x'; give a finite number >= 0"),
    ("/nonexistent/noise.json", r"noise=/nonexistent/noise.json: cannot read it as JSON"),
])
def test_a_bad_spec_is_refused_in_one_line(text, message):
  with pytest.raises(ConfigError, match=message):
    parse_noise(text)
  with pytest.raises(ConfigError, match="persist names GPU 9; cluster 'four' has GPUs 0..3"):
    Realisation(parse_noise("persist=9@0:0.5"), CLUSTER)


def test_each_gpu_draws_from_its_own_stream_whatever_the_others_do():
  spec = NoiseSpec(jitter=0.3, card=0.1, episodes=Episodes(60.0, 10.0, 0.5), seed=3)
  a, b = Realisation(spec, CLUSTER), Realisation(spec, CLUSTER)
  g0, g1 = CLUSTER.gpus[0], CLUSTER.gpus[1]
  first = [a.task_factor([g0], t) for t in range(50)]
  for t in range(50):  # another system: GPU 1 works in between, and GPU 0 is asked at the same times
    b.task_factor([g1], t + 0.5)
  assert [b.task_factor([g0], t) for t in range(50)] == first
  assert [Realisation(spec._replace(seed=4), CLUSTER).task_factor([g0], t) for t in range(50)] != first


def test_the_draws_have_the_published_shape():
  spec = NoiseSpec(jitter=0.05, episodes=Episodes(120.0, 15.0, 0.5))  # an episode every 30 s, lasting 15 s
  r = Realisation(spec, CLUSTER)
  g = CLUSTER.gpus[0]
  draws = np.array([r._next_jitter(g.index) for _ in range(40_000)])
  assert draws.mean() == pytest.approx(1.0, abs=2e-3) and draws.std() / draws.mean() == pytest.approx(0.05, rel=0.03)
  slow = np.mean([r.speed(g, t) < 1 for t in np.arange(0, 200_000, 7.0)])
  # Poisson arrivals of rate 1/30 s, exponential durations of mean 15 s, overlapping: 1 - exp(-15/30) busy
  assert slow == pytest.approx(1 - np.exp(-0.5), abs=0.01)


def test_a_gpu_slowed_to_half_from_a_time_on_takes_twice_as_long_in_both_simulators():
  layout = Layout((VWLayout((CLUSTER.gpus[0], CLUSTER.gpus[1]), (0, 1, 2), 1),))
  noise = "persist=0@1.0:0.5"  # GPU 0 (stage 0) at half its speed from t = 1 s

  def durations(noise_text):
    trace = Trace()
    simulate(SimJob(CLUSTER, UNITS, layout, 0, 8, options=SimOptions(noise=noise_text)), trace)
    assert_trace_ok(trace.events)
    return [(e["t0"], e["t1"] - e["t0"]) for e in trace.events if e["ev"] == "fwd" and e["stage"] == 0]
  plain, slowed = durations("none"), durations(noise)
  assert all(d == pytest.approx(0.1) for _, d in plain)
  assert all(d == pytest.approx(0.1 if t0 < 1.0 else 0.2) for t0, d in slowed) and any(t0 >= 1 for t0, _ in slowed)
  worker = Worker((CLUSTER.gpus[0],), (0, 2), 1)
  job = SyncJob("t", CLUSTER, (worker,), fixed(UNITS, 1), rounds=8)
  nominal = simulate_sync(job).round_seconds
  assert nominal == pytest.approx(0.6)  # 2 units forward and backward
  assert simulate_sync(job, Realisation(parse_noise("persist=0@0:0.5"), CLUSTER)).round_seconds == \
      pytest.approx(2 * nominal)


def test_no_noise_leaves_every_task_at_the_cost_models_time():
  layout = Layout((VWLayout((CLUSTER.gpus[0], CLUSTER.gpus[1]), (0, 1, 2), 2),))
  runs = []
  for text in ("none", "jitter=0"):
    trace = Trace()
    runs.append((simulate(SimJob(CLUSTER, UNITS, layout, 0, 4, options=SimOptions(noise=text)), trace)[0],
                 [e for e in trace.events if e["ev"] != "meta"]))
  assert runs[0] == runs[1]


def test_every_system_and_the_tuner_take_the_noise():
  assert {o.noise for _, o in SearchSpace(noise="jitter=0.1").settings()} == {"jitter=0.1"}
  with pytest.raises(ConfigError, match="noise='jitter=x': jitter='x'"):
    PeerKnobs(noise="jitter=x").validate()
  profiles = fixed(UNITS, 1)
  slowed = PeerKnobs(noise="persist=0@0:0.5;1@0:0.5;2@0:0.5;3@0:0.5")  # every GPU at half speed
  for name in ("horovod", "hetpipe"):
    system = get_system(name)
    plain, half = (system.simulate(CLUSTER, profiles, 1, k) for k in (PeerKnobs(), slowed))
    assert half.images_per_sec / plain.images_per_sec == pytest.approx(0.5, rel=1e-3)  # (links of 1 TB/s)


def test_a_file_may_list_explicit_events_and_a_bad_one_is_named(tmp_path):
  path = tmp_path / "events.json"
  path.write_text(json.dumps({"seed": 2, "events": [{"gpu": 1, "from": 5, "to": 8, "factor": 0.5},
                                                     {"link": 0, "from": 1, "factor": 0.25}]}))
  spec = parse_noise(str(path))
  assert spec.events == (Event("gpu", 1, 5.0, 8.0, 0.5), Event("link", 0, 1.0, float("inf"), 0.25))
  assert spec.seed == 2 and not spec.quiet
  real = Realisation(spec, CLUSTER)
  assert [real.speed(CLUSTER.gpus[1], t) for t in (4.9, 5.0, 7.9, 8.0)] == [1.0, 0.5, 0.5, 1.0]
  assert real.link_factor(0, 0.5) == 1.0 and real.link_factor(0, 1.0) == 0.25 and real.link_factor(1, 9.0) == 1.0
  for bad in ({"gpu": 1, "link": 0, "from": 0, "factor": 0.5}, {"gpu": 1, "from": 0, "factor": 2},
              {"gpu": 1, "factor": 0.5}, {"gpu": 1, "from": 0, "factor": 0.5, "until": 3}):
    path.write_text(json.dumps({"events": [bad]}))
    with pytest.raises(ConfigError, match="event 0"):
      parse_noise(str(path))
  path.write_text(json.dumps({"events": [{"link": 7, "from": 0, "factor": 0.5}]}))
  with pytest.raises(ConfigError, match="link 7; cluster 'four' has nodes 0..1"):
    Realisation(parse_noise(str(path)), CLUSTER)


def test_a_slowed_link_carries_a_flow_at_its_share_and_keeps_no_run_alive(tmp_path):
  # 1 GB from node 0 to node 1 at 1 GB/s; node 0's link at half its bandwidth from 0.5 s to 1 s: 0.5 GB by 0.5 s,
  # 0.25 GB by 1 s, the last 0.25 GB at full speed: it lands at 1.25 s. Node 1's event at 5-6 s is after the run.
  cluster = make_cluster("two", [[GPU], [GPU]], Link("pcie", 1e12, 0.0), Link("net", 1e9, 0.0))
  spec = NoiseSpec(events=(Event("link", 0, 0.5, 1.0, 0.5), Event("link", 1, 5.0, 6.0, 0.5)))
  network = Simulator(cluster, noise=Realisation(spec, cluster))
  landed = []
  network.send(0, 1, 1e9, landed.append)
  assert network.drain() == pytest.approx(1.25) and landed == [pytest.approx(1.25)]
  assert DEFAULT.links == Episodes(0.02, 1440.0, 0.5) and DEFAULT.scaled(2).links.rate_per_hour == 0.04


def test_link_episodes_are_drawn_per_node_and_change_the_bandwidth_at_their_ends():
  spec = parse_noise("link=2/600/0.5,seed=4")
  real = Realisation(spec, CLUSTER)
  t, changes = 0.0, []
  while len(changes) < 6:
    t = real.next_link_change(0, t)
    changes.append((t, real.link_factor(0, t)))
  assert [f for _, f in changes] != [1.0] * 6 and all(a < b for (a, _), (b, _) in zip(changes, changes[1:]))
  again = Realisation(spec, CLUSTER)  # the same draws, whatever node 1 was asked first
  again.next_link_change(1, 0.0)
  assert [again.link_factor(0, x) for x, _ in changes] == [f for _, f in changes]
