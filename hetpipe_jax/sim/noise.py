"""A variance model for the simulators (issue 39, item 1): GPUs whose speed is not a constant.

A :class:`NoiseSpec` describes the noise; a :class:`Realisation` draws it for one cluster from its seed, and
every system of a study simulated with the same realisation meets the same cluster: each GPU's draws come from a
stream of its own (``numpy`` generators seeded with ``(seed, what, GPU index)``), so what one GPU meets does not
depend on what the others or the system do. A task that starts at time t on a stage's GPUs takes its nominal
seconds times the largest, over those GPUs, of ``jitter_k / speed(t)`` (the k-th draw of the GPU's jitter stream,
and its speed at the task's start):

* **jitter**: each task's duration times a lognormal factor of mean 1 and coefficient of variation ``jitter``;
* **card**: each GPU's speed times a lognormal factor of mean 1 and coefficient of variation ``card``, drawn once
  (cards of one model differ), and a fraction ``slow_cards`` of the GPUs at ``slow_factor`` of their speed
  throughout (a slow machine that stays slow);
* **gpu episodes**: transient slowdowns of a GPU, arriving as a Poisson process of ``rate_per_hour`` per GPU,
  lasting an exponential time of mean ``mean_s``, the GPU at ``factor`` of its speed meanwhile;
* **persistent**: named GPUs at a factor of their speed from a time on (``persist=GPU@SECONDS:FACTOR``).

Defaults (``--noise=default``, :data:`DEFAULT`), from published measurements:

* jitter 0.02: repeated GEMMs on one GPU vary by 0.98-6.46% (Golden et al., "PRISM", arXiv 2510.15596; the
  weakest of these figures: the paper's measure of variation is a spread, read here as a CoV near its low end);
* card 0.02: GPUs of one model vary by 8% on average across five clusters (Sinha et al., "Not All GPUs Are
  Created Equal", SC'22, arXiv 2208.11035 v3), a spread of about 4-6 standard deviations;
* slow cards 0.5% at 0.9: about 0.5% of machines about 10% slower, steadily (Jiang et al., "MegaScale",
  NSDI'24, section 6.3; Wu et al., "Greyhound", USENIX ATC'25, section 3.2, the same rate);
* gpu episodes 0.001 per GPU-hour, mean 600 s, factor 0.8: 2 GPU-caused computation fail-slows in 392 probe
  jobs of 4 GPUs for 70-90 minutes (about 2,091 GPU-hours), lasting 10 minutes on average, one GPU 20% slower
  (Greyhound, section 3.2 and Table 1; a lower bound, counted per job).

* link episodes 0.02 per node-link-hour, mean 1,440 s, factor 0.5: network congestion in 42 of 107 four-node
  jobs of about 5 hours (42 / (107 x 5 h x 4 links)), 24 minutes on average (Greyhound, section 3.3 and Table 1;
  a shared fabric's figure: an overprovisioned one sees almost none, MegaScale section 3.1). The bandwidth a
  congested link keeps is not published; 0.5 lies inside the bounds its throughput drops give (0.72 and 0.54 of
  the iterations per second in the four-node probe of its Fig. 4).

A link episode is a node's network link (its egress and its ingress) at ``factor`` of its bandwidth meanwhile
(the simulators' flows re-share it at its start and end); PCIe inside a node does not vary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hetpipe_jax.cluster import Cluster, Gpu
from hetpipe_jax.errors import ConfigError

_CHUNK_S = 3600.0  # episodes are drawn an hour of simulated time at a time, as far as a query reaches
_BLOCK = 256  # jitter factors are drawn this many at a time per GPU
_HORIZON_S = 3600.0 * 10_000  # a link's next change is looked for this far ahead


class Episodes(NamedTuple):
  """Transient slowdowns of a GPU: arrivals per hour (a Poisson process), mean duration (exponential, seconds),
  and the fraction of its speed the GPU keeps meanwhile."""

  rate_per_hour: float = 0.0
  mean_s: float = 0.0
  factor: float = 1.0


class Event(NamedTuple):
  """An explicit slowdown (a noise file's ``events``): GPU ``index`` (``what="gpu"``) or node ``index``'s network
  link (``"link"``) at ``factor`` of its speed or bandwidth from ``start`` until ``end`` seconds (inf: on)."""

  what: str
  index: int
  start: float
  end: float
  factor: float


class NoiseSpec(NamedTuple):
  """The noise of a cluster (see the module docstring): ``jitter`` and ``card`` coefficients of variation,
  GPU ``episodes``, the ``slow_cards`` fraction at ``slow_factor``, ``persistent`` changes (GPU index, from
  seconds, factor), the ``seed`` of every draw, ``links``: episodes of each node's network link, and explicit
  ``events``."""

  jitter: float = 0.0
  card: float = 0.0
  episodes: Episodes = Episodes()
  slow_cards: float = 0.0
  slow_factor: float = 1.0
  persistent: tuple[tuple[int, float, float], ...] = ()
  seed: int = 0
  links: Episodes = Episodes()
  events: tuple[Event, ...] = ()

  @property
  def quiet(self) -> bool:
    """Whether nothing varies (every GPU at its nominal speed for every task)."""
    return (not self.jitter and not self.card and not self.episodes.rate_per_hour and not self.slow_cards
            and not self.persistent and not self.links.rate_per_hour and not self.events)

  def scaled(self, k: float) -> NoiseSpec:
    """This noise ``k`` times as strong: coefficients, rates and the slow fraction times k (durations and
    factors as they are)."""
    return self._replace(jitter=self.jitter * k, card=self.card * k, slow_cards=min(1.0, self.slow_cards * k),
                         episodes=self.episodes._replace(rate_per_hour=self.episodes.rate_per_hour * k),
                         links=self.links._replace(rate_per_hour=self.links.rate_per_hour * k))


NONE = NoiseSpec()
DEFAULT = NoiseSpec(jitter=0.02, card=0.02, episodes=Episodes(0.001, 600.0, 0.8), slow_cards=0.005, slow_factor=0.9,
                    links=Episodes(0.02, 1440.0, 0.5))
KEYS = ("jitter", "card", "gpu", "link", "slow", "persist", "seed")
FILE_KEYS = (*KEYS, "events")  # a noise file may list explicit events too
HELP = ("none; default (published measurements: docs); default*K (K times as strong), either followed by "
        ",KEY=VALUE,... to replace some (default,seed=2); or KEY=VALUE,... of "
        "jitter=COV, card=COV, gpu=RATE_PER_HOUR/MEAN_S/FACTOR, link=RATE_PER_HOUR/MEAN_S/FACTOR, "
        "slow=FRACTION/FACTOR, persist=GPU@SECONDS:FACTOR[;...], seed=N (a key not given: no such noise); or a JSON "
        "file of those keys and \"events\": [{\"gpu\" or \"link\": N, \"from\": S, \"to\": S, \"factor\": F}, ...]")


def parse_noise(text: str) -> NoiseSpec:
  """A :class:`NoiseSpec` from a flag (:data:`HELP`).

  Raises:
    ConfigError: one line naming the bad part and the syntax.
  """
  text = text.strip()
  if text in ("", "none"):
    return NONE
  base = NONE
  if text.startswith("default"):  # default[*K][,KEY=VALUE,...]: the defaults, some keys replaced
    head, _, text = text.partition(",")
    base = DEFAULT if head == "default" else DEFAULT.scaled(_number("noise", head, head[len("default*"):], 0.0)) \
        if head.startswith("default*") else None
    if base is None:
      raise ConfigError(f"noise={head!r}; give default, default*K or default[*K],KEY=VALUE,... ({HELP})")
    if not text:
      return base
  elif text.endswith(".json"):
    return _from_file(text)
  fields = {}
  for part in text.split(","):
    key, sep, value = part.partition("=")
    if not sep or key.strip() not in KEYS:
      raise ConfigError(f"noise={text!r}: {part!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}; give {HELP}")
    fields[key.strip()] = value.strip()
  return _spec(fields, f"noise={text!r}", base)


def _from_file(path: str) -> NoiseSpec:
  try:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"noise={path}: cannot read it as JSON ({type(e).__name__}: {e}); give {HELP}") from None
  if not isinstance(doc, dict) or any(k not in FILE_KEYS for k in doc):
    unknown = sorted(set(doc) - set(FILE_KEYS)) if isinstance(doc, dict) else type(doc).__name__
    raise ConfigError(f"noise={path}: {unknown} not among the keys {', '.join(FILE_KEYS)}; give an object of them")
  events = doc.pop("events", [])
  if not isinstance(events, list):
    raise ConfigError(f"noise={path}: events is a {type(events).__name__}; give a list of events ({HELP})")
  spec = _spec({k: str(v) for k, v in doc.items()}, f"noise={path}")
  return spec._replace(events=tuple(_event(f"noise={path}: event {k}", e) for k, e in enumerate(events)))


def _event(what: str, item: object) -> Event:
  keys = {"gpu", "link", "from", "to", "factor"}
  if not isinstance(item, dict) or set(item) - keys or len({"gpu", "link"} & set(item)) != 1 or \
      not {"from", "factor"} <= set(item):
    raise ConfigError(f"{what}: {item!r}; give {{\"gpu\" or \"link\": N, \"from\": S, \"to\": S (optional: for "
                      "good), \"factor\": F}")
  kind = "gpu" if "gpu" in item else "link"
  start = _number(what, "from", str(item["from"]), 0.0)
  end = _number(what, "to", str(item["to"]), start) if "to" in item else math.inf
  return Event(kind, int(_number(what, kind, str(item[kind]), 0.0)), start, end,
               _factor(what, "factor", str(item["factor"])))


def _spec(fields: dict[str, str], what: str, base: NoiseSpec = NONE) -> NoiseSpec:
  spec = base
  if "jitter" in fields:
    spec = spec._replace(jitter=_number(what, "jitter", fields["jitter"], 0.0))
  if "card" in fields:
    spec = spec._replace(card=_number(what, "card", fields["card"], 0.0))
  if "gpu" in fields:
    spec = spec._replace(episodes=_episodes(what, "gpu", fields["gpu"]))
  if "link" in fields:
    spec = spec._replace(links=_episodes(what, "link", fields["link"]))
  if "slow" in fields:
    fraction, factor = _parts(what, "slow", fields["slow"], "/", 2)
    spec = spec._replace(slow_cards=min(1.0, _number(what, "slow fraction", fraction, 0.0)),
                         slow_factor=_factor(what, "slow factor", factor))
  if "persist" in fields:
    spec = spec._replace(persistent=tuple(_persist(what, p) for p in fields["persist"].split(";") if p.strip()))
  if "seed" in fields:
    spec = spec._replace(seed=int(_number(what, "seed", fields["seed"], 0.0)))
  return spec


def _episodes(what: str, key: str, value: str) -> Episodes:
  rate, mean, factor = _parts(what, key, value, "/", 3)
  return Episodes(_number(what, f"{key} rate", rate, 0.0), _number(what, f"{key} mean", mean, 0.0),
                  _factor(what, f"{key} factor", factor))


def _parts(what: str, key: str, value: str, sep: str, n: int) -> list[str]:
  parts = value.split(sep)
  if len(parts) != n:
    raise ConfigError(f"{what}: {key}={value!r} has {len(parts)} parts; give {n} separated by {sep!r} ({HELP})")
  return parts


def _number(what: str, key: str, value: str, low: float) -> float:
  try:
    x = float(value)
  except ValueError:
    x = math.nan
  if not math.isfinite(x) or x < low:
    raise ConfigError(f"{what}: {key}={value!r}; give a finite number >= {low:g}")
  return x


def _factor(what: str, key: str, value: str) -> float:
  x = _number(what, key, value, 0.0)
  if not 0 < x <= 1:
    raise ConfigError(f"{what}: {key}={value!r}; give the fraction of its speed a GPU keeps, in (0, 1]")
  return x


def _persist(what: str, part: str) -> tuple[int, float, float]:
  gpu, sep, rest = part.partition("@")
  when, sep2, factor = rest.partition(":")
  if not sep or not sep2:
    raise ConfigError(f"{what}: persist={part!r}; give GPU@SECONDS:FACTOR (GPU: its index in the cluster)")
  return int(_number(what, "persist GPU", gpu, 0.0)), _number(what, "persist time", when, 0.0), \
      _factor(what, "persist factor", factor)


def _lognormal(rng: np.random.Generator, cov: float, size: int) -> np.ndarray:
  """Factors of mean 1 and coefficient of variation ``cov`` (ones for 0)."""
  if not cov:
    return np.ones(size)
  sigma2 = math.log1p(cov * cov)
  return rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), size)


class Realisation:
  """One draw of ``spec`` on ``cluster`` (see the module docstring).

  Raises:
    ConfigError: for a persistent change of a GPU the cluster does not have.
  """

  def __init__(self, spec: NoiseSpec, cluster: Cluster):
    self.spec = spec
    indices = [g.index for g in cluster.gpus]
    nodes = sorted({g.node for g in cluster.gpus})
    for gpu, _, _ in spec.persistent:
      if gpu not in indices:
        raise ConfigError(f"noise: persist names GPU {gpu}; cluster {cluster.name!r} has GPUs 0..{len(indices) - 1}")
    for e in spec.events:
      if e.index not in (indices if e.what == "gpu" else nodes):
        raise ConfigError(f"noise: an event names {e.what} {e.index}; cluster {cluster.name!r} has "
                          f"{'GPUs' if e.what == 'gpu' else 'nodes'} {min(indices if e.what == 'gpu' else nodes)}.."
                          f"{max(indices if e.what == 'gpu' else nodes)}")
    rng = np.random.default_rng([spec.seed, 0])
    card = _lognormal(rng, spec.card, len(indices))
    slow = rng.random(len(indices)) < spec.slow_cards
    self._card = {i: float(c) * (spec.slow_factor if s else 1.0) for i, c, s in zip(indices, card, slow)}
    self._episodes = {i: _Process(spec.episodes, np.random.default_rng([spec.seed, 1, i])) for i in indices}
    self._links = {n: _Process(spec.links, np.random.default_rng([spec.seed, 3, n])) for n in nodes}
    self._link_events = {n: [e for e in spec.events if e.what == "link" and e.index == n] for n in nodes}
    self._jitter = {i: np.random.default_rng([spec.seed, 2, i]) for i in indices}
    self._pending: dict[int, list[float]] = {i: [] for i in indices}

  def card(self, gpu: Gpu) -> float:
    """``gpu``'s speed factor for the whole run (its card and its slow class)."""
    return self._card[gpu.index]

  def speed(self, gpu: Gpu, t: float) -> float:
    """``gpu``'s speed at time ``t``, as a fraction of its nominal speed."""
    s = self._card[gpu.index]
    if self.spec.episodes.rate_per_hour and self._episodes[gpu.index].active(t):
      s *= self.spec.episodes.factor
    for index, when, factor in self.spec.persistent:
      if index == gpu.index and t >= when:
        s *= factor
    for e in self.spec.events:
      if e.what == "gpu" and e.index == gpu.index and e.start <= t < e.end:
        s *= e.factor
    return s

  def task_factor(self, gpus: Sequence[Gpu], t: float) -> float:
    """What a task of a stage on ``gpus`` (a split stage: all of them) that starts at ``t`` takes, times its
    nominal seconds: the slowest GPU's next jitter draw over its speed at ``t``."""
    return max(self._next_jitter(g.index) / self.speed(g, t) for g in gpus)

  def _next_jitter(self, index: int) -> float:
    if not self.spec.jitter:
      return 1.0
    pending = self._pending[index]
    if not pending:
      pending.extend(reversed(_lognormal(self._jitter[index], self.spec.jitter, _BLOCK).tolist()))
    return pending.pop()

  @property
  def links_vary(self) -> bool:
    """Whether any link's bandwidth varies."""
    return bool(self.spec.links.rate_per_hour) or any(e.what == "link" for e in self.spec.events)

  def link_factor(self, node: int, t: float) -> float:
    """The fraction of its bandwidth ``node``'s network link keeps at time ``t`` (an episode's factor, times
    every explicit event's then)."""
    f = self.spec.links.factor if self.spec.links.rate_per_hour and self._links[node].active(t) else 1.0
    for e in self._link_events[node]:
      if e.start <= t < e.end:
        f *= e.factor
    return f

  def next_link_change(self, node: int, t: float) -> float:
    """The first time after ``t`` at which ``node``'s link's bandwidth may change (inf: none)."""
    drawn = self._links[node].next_change(t) if self.spec.links.rate_per_hour else math.inf
    return min([drawn, *(x for e in self._link_events[node] for x in (e.start, e.end) if x > t)])


class _Process:
  """Episodes of one GPU or link: Poisson arrivals of ``spec.rate_per_hour``, exponential durations of mean
  ``spec.mean_s``, drawn an hour of simulated time at a time as far as a query reaches."""

  def __init__(self, spec: Episodes, rng: np.random.Generator):
    self.spec, self.rng = spec, rng
    self.episodes: list[tuple[float, float]] = []  # (start, end)
    self.drawn = 0.0  # episodes drawn up to this time

  def _draw_to(self, t: float) -> None:
    rate = self.spec.rate_per_hour
    while self.drawn <= t:  # the Poisson arrivals of the next hour, each with its duration
      start, end = self.drawn, self.drawn + _CHUNK_S
      arrival = start + self.rng.exponential(3600.0 / rate)
      while arrival < end:
        self.episodes.append((arrival, arrival + self.rng.exponential(self.spec.mean_s)))
        arrival += self.rng.exponential(3600.0 / rate)
      self.drawn = end

  def active(self, t: float) -> bool:
    self._draw_to(t)
    return any(a <= t < b for a, b in self.episodes)

  def next_change(self, t: float) -> float:
    """The first start or end of an episode after ``t`` (looking as far as :data:`_HORIZON_S`; inf beyond)."""
    reach = t
    while reach < t + _HORIZON_S:
      self._draw_to(reach)
      later = [x for a, b in self.episodes for x in (a, b) if x > t]
      if later and min(later) <= self.drawn:  # (an episode drawn later starts after this hour's draws)
        return min(later)
      reach = self.drawn
    return math.inf


def realise(text: str, cluster: Cluster) -> Realisation | None:
  """The realisation of the noise ``text`` (:func:`parse_noise`) on ``cluster``; None when nothing varies.

  Raises:
    ConfigError: for a bad spec.
  """
  spec = parse_noise(text)
  return None if spec.quiet else Realisation(spec, cluster)
