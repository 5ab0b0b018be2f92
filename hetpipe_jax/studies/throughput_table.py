"""The throughput study's table of one model: the peers, HetPipe NP, ED and HD at every Nm rule and D, the tuned
rows, each row's ratio to the best peer and goodput mark, and the headline (:mod:`hetpipe_jax.studies.throughput`).
"""

from __future__ import annotations

from hetpipe_jax.errors import ConfigError
from hetpipe_jax.plan.allocation import plan_cluster
from hetpipe_jax.staleness import StalenessModel
from hetpipe_jax.studies.throughput_goodput import NOT_TRAINED, REACHES, goodput
from hetpipe_jax.studies.throughput_records import Headline, ModelStudy, best_peer, describe
from hetpipe_jax.systems import HetPipe, simulate_systems
from hetpipe_jax.systems.hetpipe import plan_config, rule_tag
from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, tune

HETPIPE = HetPipe.name
POLICIES = ("NP", "ED", "HD")
TUNED, TUNED_IPS, TUNED_OUTER = "HetPipe tuned", "HetPipe tuned for images/s", "HetPipe tuned + outer"


def peer_entries(s: ModelStudy) -> None:
  """The systems of ``config.systems``, simulated with ``config.knobs`` (microbatches 0: the cluster's GPUs)."""
  knobs = s.config.knobs
  knobs = knobs._replace(microbatches=knobs.microbatches or s.cluster.num_gpus)
  for spec in simulate_systems(s.config.systems, s.cluster, s.batch_profiles, s.batch, s.costs, knobs,
                               model=s.model_name, progress=s.say):
    name = spec.system.name
    if spec.run is None:
      s.entry(name, name, "", None, None, spec.reason)
      continue
    s.entry(name, name, spec.system.config(spec.run), spec.run.gpus, spec.run.images_per_sec,
            signature=spec.system.signature(spec.run))
    if spec.run.timeline is not None:
      s.ran[name] = spec.run.timeline


def policy_row(policy: str, nm_rule: str, d: int, tp: int | str = 1) -> str:
  """A HetPipe policy row's name: ``HetPipe NP D=0`` at max_fit (a convergence study's name for its rows at any
  rule), ``HetPipe NP speed D=0`` at another rule, ``HetPipe NP D=0 tp=2`` at a tensor-parallel degree."""
  return f"HetPipe {policy}{rule_tag(nm_rule)} D={d}" + ("" if tp == 1 else f" tp={tp}")


def hetpipe_entries(s: ModelStudy) -> None:
  """HetPipe NP, ED, HD at every Nm rule of ``config.nms`` and every D: the planner's partitions and Nm, default
  placement. A row of another rule than max_fit is marked too by the convergence runs of its policy's row that
  trained its configuration (a convergence study names its rows at any ``--nm`` as max_fit's)."""
  for policy in POLICIES:
    for nm_rule in s.config.nms:
      rows = [policy_row(policy, nm_rule, d, s.config.knobs.tp) for d in s.config.ds]
      s.trained_as.update({row: policy_row(policy, "max_fit", d, s.config.knobs.tp) for row, d in zip(rows, s.config.ds)
                           if nm_rule != "max_fit"})
      try:
        plan = plan_cluster(s.cluster, s.profiles, policy, "default", nm_rule, None, s.costs, s.config.knobs.tp)
      except ConfigError as e:
        for row in rows:
          s.entry(row, HETPIPE, "", None, None, str(e))
        continue
      for row, d in zip(rows, s.config.ds):
        s.entry(row, HETPIPE, plan_config(plan), s.cluster.num_gpus, s.simulated_images_per_sec(plan.vws, d, row=row),
                signature=[[p.nm for p in plan.vws], d])


def staleness_model(s: ModelStudy) -> StalenessModel | None:
  """The staleness model of the first matching convergence file that has one (None: none)."""
  for doc in s.convergence:
    fit = doc.get("staleness_model")
    if fit:
      return StalenessModel(fit["images0"], fit["beta"], fit.get("target_accuracy"))
  return None


def tuned_entries(s: ModelStudy) -> None:
  """HetPipe tuned, tuned for images/s, and tuned + outer (the tuned one's timing). The tuned rows are the
  configurations a matching convergence study chose and trained, when the tuner's search holds them (so their
  goodput marks are theirs); else the tuner's best by ``config.tuned_objective`` and by images/s."""
  fit = staleness_model(s) if s.config.tuned_objective == "time_to_accuracy" else None
  try:
    out = tuned_search(s, fit)
  except ConfigError as e:
    for row in (TUNED, TUNED_IPS, TUNED_OUTER):
      s.entry(row, HETPIPE, "", None, None, str(e))
    return
  fastest = max(out.results, key=lambda r: r.images_per_sec)
  best, why = out.best, ("by predicted time to accuracy (staleness model of the convergence study)" if fit else
                         "by images/s" + ("" if s.config.tuned_objective == "throughput" else
                                          ": no staleness model from --convergence"))
  objective = "time_to_accuracy" if fit else "throughput"
  trained = [doc["tuned"] for doc in s.convergence if isinstance(doc.get("tuned"), dict) and doc["tuned"].get("label")]
  if trained:
    by_label = {r.candidate.label: r for r in out.results}
    chosen = by_label.get(trained[0]["label"])
    if chosen is not None:
      best, why, objective = chosen, f"as the convergence study chose it ({trained[0].get('objective')})", "study"
    fast = by_label.get((trained[0].get("fastest") or {}).get("label", ""))
    fastest = fast or fastest
  gpus = s.cluster.num_gpus
  s.notes.append(f"{TUNED} (+ outer): {why}: {best.candidate.label}")
  s.notes.append(f"{TUNED_IPS}: {fastest.candidate.label}")
  sign = lambda c: [[p.nm for p in c.plans], c.d]
  s.entry(TUNED, HETPIPE, best.candidate.label, gpus, best.images_per_sec, objective=objective,
          signature=sign(best.candidate))
  s.entry(TUNED_IPS, HETPIPE, fastest.candidate.label, gpus, fastest.images_per_sec, objective="throughput",
          signature=sign(fastest.candidate))
  s.ran[TUNED] = best.candidate.job(s.cluster, s.profiles, s.config.waves)
  s.ran[TUNED_IPS] = fastest.candidate.job(s.cluster, s.profiles, s.config.waves)
  s.entry(TUNED_OUTER, HETPIPE, f"as {TUNED}, + outer optimizer at the PS (same timing)", gpus,
          best.images_per_sec, objective=objective, signature=sign(best.candidate))


def tuned_search(s: ModelStudy, fit: StalenessModel | None):
  """The tuner's search (its best by images/s with ``fit`` None, else by predicted time to accuracy)."""
  what = "images/s" if fit is None else "time to accuracy"
  space = SearchSpace(ds=tuple(s.config.tune_ds or s.config.ds), max_stages=s.config.max_stages or None,
                      tp=s.config.knobs.tp, noise=s.config.knobs.noise)
  out = tune(s.cluster, s.profiles, s.batch, space,
             TuneOptions(waves=s.config.waves, staleness_model=fit, setting=RunSetting(s.costs), front=6,
                         progress=lambda line: s.say(f"{s.model_name} tuner ({what}): {line}")))
  s.say(f"{s.model_name} tuned by {what} ({out.best.candidate.label}): {out.best.images_per_sec:.1f} images/s")
  return out


def finish_table(s: ModelStudy) -> None:
  """Every entry's ratio to the best peer and goodput mark."""
  peer = best_peer(s.table)
  finished = []
  for e in s.table:
    ratio = e.images_per_sec / peer.images_per_sec if e.images_per_sec is not None and peer is not None and \
        peer.images_per_sec else None
    mark, seconds = goodput(s.convergence, e.row, e.signature)
    if mark == NOT_TRAINED and e.row in s.trained_as:
      mark, seconds = goodput(s.convergence, s.trained_as[e.row], e.signature, strict=True)
    finished.append(e._replace(ratio_to_best_peer=ratio, goodput=mark, time_to_target_s=seconds))
  s.table = finished


def headline(s: ModelStudy) -> Headline:
  """The fastest row that reaches the target (without convergence data: the fastest row), and the fastest."""
  ran = [e for e in s.table if e.images_per_sec]
  fastest = max(ran, key=lambda e: e.images_per_sec or 0.0, default=None)
  known = any(not e.goodput.startswith(NOT_TRAINED) for e in s.table)
  best = max((e for e in ran if e.goodput == REACHES), key=lambda e: e.images_per_sec or 0.0, default=None)
  where = f"{s.model_name} on {s.cluster.name}"
  if not known:
    best = fastest
    note = (f"no convergence data for {where} (read: {', '.join(s.sources) or 'none'}); "
            f"goodput unknown: the fastest row, {describe(fastest)}")
  elif best is None:
    note = f"no row of {where} reaches the target in {', '.join(d['path'] for d in s.convergence)}"
  else:
    note = (f"the fastest row that reaches the target {target(s)}: {describe(best)}")
  return Headline(None if best is None else best.row, known, None if best is None else best.images_per_sec,
                  None if best is None else best.throughput, s.unit, None if best is None else best.ratio_to_best_peer,
                  None if fastest is None else fastest.row, None if fastest is None else fastest.throughput, note)


def target(s: ModelStudy) -> str:
  values = sorted({d["target_accuracy"] for d in s.convergence if d.get("target_accuracy") is not None})
  return "/".join(f"{v:.4g}" for v in values) or "?"

