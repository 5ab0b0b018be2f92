r"""Train a model with HetPipe on an emulated heterogeneous cluster.

Runs with no flags on embedded defaults: a small CNN on Fashion-MNIST (digits when it is not installed),
3 virtual workers of 2 stages each on the 4-speed-class ``hetero4`` cluster, Nm = 2, D = 1, the
deterministic ``virtual`` executor. Writes the trace, the metrics (JSON Lines), a summary and a PNG of
loss and accuracy against time, a Gantt chart of the first waves and a Chrome/Perfetto trace, checks the
trace against the WSP guarantees, and prints the paths::

  python -m experiments.train
  python -m experiments.train --num_vws=3 --stages=2 --nm=3 --d=1 --waves=6 --executor=wall \
      --trace_out=t.jsonl
  python -m experiments.train --model=gpt --dataset=tokens --optimizer=adam --learning_rate=0.003 --waves=30
  python -m experiments.train --model=gpt --dataset=text --optimizer=adam --learning_rate=0.001 --waves=150
  python -m experiments.train --model=gpt-6.7b --seq_len=1024 --batch_size=1 --precision=bf16 \
      --optimizer=adam --executor=sim --cluster=paper_testbed --policy=0,1,2,3,4,5,6,7 --waves=5
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NamedTuple

from absl import flags

from experiments import common, run_flags
from hetpipe_jax import (
  ConfigError,
  RunConfig,
  check_trace,
  get_cluster,
  get_model,
  load_dataset,
  run_hetpipe,
  staleness_stats,
)
from hetpipe_jax.core.check import as_version_1
from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.data import text_installed
from hetpipe_jax.errors import RunStopped
from hetpipe_jax.evaluate import LanguageScore, language_score
from hetpipe_jax.models import FULL_SIZE, full_size_model, full_size_spec
from hetpipe_jax.optim import optimizer_slots
from hetpipe_jax.run.preflight import refuse_before_launch
from hetpipe_jax.run.result import RunResult, ran_config
from hetpipe_jax.runtime.transport.launch import check_port_free, child_environment, free_port, launch
from hetpipe_jax.runtime.transport.node import current_node, join
from hetpipe_jax.sim.options import ELSEWHERE
from hetpipe_jax.systems import get_system
from hetpipe_jax.tune.peers import HETPIPE, peer_knobs, system_of, tuner_profiles
from hetpipe_jax.viz.timeline import chrome_trace, plot_gantt
from hetpipe_jax.viz.training import plot_training

FLAGS = flags.FLAGS
# Every setting of a run, with its default and help where RunConfig declares it (hetpipe_jax.run.config); the
# CLI's own default: 120 waves, a run that trains (the library's RunConfig runs 50).
run_flags.define(overrides={"waves": 120})
flags.adopt_module_key_flags(run_flags)
flags.DEFINE_string("coordinator_address", None, "multiprocess: HOST:PORT of the coordination service "
                    "(process 0 hosts it); without it, the job starts one process per node on this host.")
flags.DEFINE_integer("process_id", None, "multiprocess: this process's index = its node, 0..nodes-1.")
flags.DEFINE_integer("num_processes", None, "multiprocess: the job's processes (= the cluster's nodes).")
flags.DEFINE_float("job_timeout", 3600, "multiprocess launcher: seconds before the whole job is killed.")
flags.DEFINE_string("plan", None, "A tuned plan (tune.json of experiments.tune): run its --plan_entry "
                    "configuration (model, cluster, batch size, grouping, cuts, Nm, D, placement, ...); a flag given "
                    "beside it that disagrees is refused. On a numerics executor, --model=SMALL trains that model on "
                    "the plan's full-size model's clock. A peer's configuration (its system: hetero_dp, ...) is "
                    "simulated with its knobs on the sim executor.")
flags.DEFINE_string("plan_entry", "best", "--plan: which configuration of the tuned plan runs: best (the best of any "
                    "system searched, HetPipe's or a peer's) or best_hetpipe (the best HetPipe one).")
flags.DEFINE_string("out_dir", "outputs/train", "Directory for every output.")
flags.DEFINE_string("trace_out", None, "Trace path (default: OUT_DIR/trace.jsonl).")
flags.DEFINE_string("metrics_out", None, "Metrics path (default: OUT_DIR/metrics.jsonl).")


def launch_nodes(config: RunConfig, job_timeout: float) -> None:
  """``--executor=multiprocess`` without a coordinator: runs this command as one process per node of
  ``config``'s cluster on this host (loopback) and waits for them; one failure or a hang ends all of them.
  What every launched process would refuse is refused here first, before anything starts."""
  refuse_before_launch(config)
  cluster = get_cluster(config.cluster) if isinstance(config.cluster, str) else config.cluster
  nodes = sorted({g.node for g in cluster.gpus})
  coordinator = f"127.0.0.1:{free_port()}"
  cmd = [sys.executable, "-m", "experiments.train", *sys.argv[1:], f"--coordinator_address={coordinator}",
         f"--num_processes={len(nodes)}"]
  env = child_environment()
  common.progress("launching %d processes (one per node) on this host, coordinator %s", len(nodes), coordinator)
  result = launch([cmd + [f"--process_id={i}"] for i in range(len(nodes))], [env] * len(nodes),
                  job_timeout, grace_s=60, names=[f"node {n}" for n in nodes], survivable=True)
  if result.ok and result.lost:
    print(f"lost during the run: {'; '.join(result.lost)} (the job went on without them: see the trace's "
          "leave events)", flush=True)
  if not result.ok:  # a run that process 0 stopped on purpose has said why in one line already
    raise SystemExit(1 if result.stopped else f"error: {result.message}")


def join_job(cluster_name: str, coordinator_address: str, num_processes: int | None, process_id: int | None) -> None:
  """Joins the multi-process job as ``process_id`` with the CPU devices of its node (before JAX computes)."""
  cluster = get_cluster(cluster_name)
  nodes = sorted({g.node for g in cluster.gpus})
  if num_processes != len(nodes):
    raise ConfigError(f"--num_processes={num_processes} but cluster {cluster.name!r} has {len(nodes)} "
                      f"nodes; run one process per node (--num_processes={len(nodes)})")
  if process_id is None or not 0 <= process_id < len(nodes):
    raise ConfigError(f"--process_id={process_id}; give each of the {len(nodes)} processes a distinct "
                      f"id in 0..{len(nodes) - 1}")
  if process_id == 0:
    check_port_free(coordinator_address)  # process 0 hosts the coordination service
  join(coordinator_address, len(nodes), process_id, local_devices=len(cluster.node_gpus(nodes[process_id])),
       recoverable=True)


class TunedPlan(NamedTuple):
  """The tuned plan a run follows (``--plan``): where it is, which entry, what it predicted, and the full-size
  model whose clock a small model's numerics run on (None: the plan's own model)."""

  path: str
  entry: str
  images_per_sec: float
  waves: int | None
  time_model: str | None


# What a tuned plan sets (a flag given beside it must match).
PLAN_FLAGS = ("model", "dataset", "cluster", "batch_size", "optimizer", "weight_mode", "staleness", "recompute",
              "schedule", "policy", "cuts", "nm", "window", "d", "placement", "overlap_transfers", "staged_ps", "tp",
              "noise")


def _plan_values(best: dict, dataset: str) -> dict:
  """The flag values a tuned plan's best configuration sets (``dataset``: the flag's, when the plan has none)."""
  return {
      "model": best["model"], "cluster": best["cluster"], "batch_size": int(best["batch_size"]),
      "optimizer": best["optimizer"], "weight_mode": best["weight_mode"],
      "staleness": best.get("staleness", "per_minibatch"),  # (a plan tuned before the controls: the paper's)
      "recompute": best.get("recompute", "none"), "schedule": best["schedule"],
      "policy": ";".join(",".join(map(str, g)) for g in best["policy"]),
      "cuts": ";".join(",".join(map(str, c)) for c in best["cuts"]), "nm": [str(n) for n in best["nm"]],
      "window": [str(n) for n in best.get("window", best["nm"])],
      "d": int(best["d"]), "placement": best["placement"], "overlap_transfers": bool(best["overlap_transfers"]),
      "staged_ps": bool(best.get("staged_ps", False)), "tp": str(_plan_degree(best)),
      "noise": best.get("noise", "none"),  # the variance it was tuned under (sim executor)
      "dataset": best.get("dataset") or dataset}  # a small model's plan was profiled on its dataset


def _plan_degree(best: dict) -> int:
  """The tensor-parallel degree of a tuned plan's configuration: 1 + each stage's partners (the tuner splits every
  stage alike); 1 without ``tp``.

  Raises:
    ValueError: for stages split unevenly (not a plan the tuner writes).
  """
  degrees = {1 + len(partners) for vw in best.get("tp") or [] for partners in vw} or {1}
  if len(degrees) != 1:
    raise ValueError(f"its stages are split over {sorted(degrees)} GPUs; a run takes one degree")
  return degrees.pop()


def read_plan(path: str, entry: str) -> dict:
  """The ``entry`` configuration of the tuned plan ``path`` (``best`` or ``best_hetpipe``; a plan written before
  ``best_hetpipe`` existed serves it from its ``best``, HetPipe's then).

  Raises:
    ConfigError: for an unreadable plan, or one without that entry.
  """
  try:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
    found = doc.get(entry)
    if found is None and entry == "best_hetpipe" and system_of(doc["best"]) == HETPIPE:
      found = doc["best"]  # a plan from before peers were searched: its best is HetPipe's
    if found is None:
      raise ConfigError(f"--plan={path} has no {entry!r} configuration; give --plan_entry=best or best_hetpipe")
    if not isinstance(found, dict):
      raise TypeError(f"its {entry!r} is a {type(found).__name__}, not an object")
  except ConfigError:
    raise
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f"--plan={path}: not a tuned plan ({type(e).__name__}: {e}); write one with python -m "
                      "experiments.tune") from None
  return found


# What a peer's tuned plan sets (a flag given beside it must match).
PEER_PLAN_FLAGS = ("model", "dataset", "cluster", "batch_size", "optimizer", "weight_mode")


class PeerPlan(NamedTuple):
  """A peer's configuration of a tuned plan: its system, label and knobs, the values of :data:`PEER_PLAN_FLAGS`
  it sets, and the plan (path, entry, predicted examples/s)."""

  system: str
  label: str
  knobs: Any
  values: dict[str, Any]
  path: str
  entry: str
  predicted: float | None


def peer_plan(flag_values: flags.FlagValues, entry: dict) -> PeerPlan:
  """The peer configuration ``entry`` of ``--plan``, checked against the flags.

  Raises:
    ConfigError: on another executor than sim, for a flag given beside the plan that disagrees with it, or a
      plan that is not one.
  """
  fv, system = flag_values, system_of(entry)
  if fv.executor != "sim":
    raise ConfigError(f"--plan={fv.plan}: a peer plan (system {system}) runs on the sim executor; train its "
                      "numerics with experiments.convergence")
  try:
    values = {"model": entry["model"], "dataset": entry.get("dataset") or fv.dataset,
              "cluster": entry["cluster"], "batch_size": int(entry["batch_size"]),
              "optimizer": entry.get("optimizer", fv.optimizer),
              "weight_mode": entry.get("weight_mode", fv.weight_mode)}
    knobs = peer_knobs(entry)
  except ConfigError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise ConfigError(f"--plan={fv.plan}: not a tuned plan ({type(e).__name__}: {e}); write one with python -m "
                      "experiments.tune") from None
  for name in PEER_PLAN_FLAGS:
    if fv[name].present and fv[name].value != values[name]:
      raise ConfigError(f"--{name}={fv[name].value} disagrees with --plan={fv.plan}, which sets "
                        f"{name}={values[name]}; drop --{name} or tune again with it")
  return PeerPlan(system, entry.get("label", system), knobs, values, fv.plan, fv.plan_entry,
                  entry.get("images_per_sec"))


def run_peer_plan(peer: PeerPlan, precision: str, out_dir: str) -> None:
  """Simulates the peer a tuned plan's configuration names, with its knobs, on the sim executor: writes its
  timeline (``python -m hetpipe_jax.efficiency`` reads it) and a summary into ``out_dir`` and prints its images/s
  and efficiency, last ``images_per_sec=<x> efficiency=<y>`` (examples/s, as the tuner ranks them).

  Raises:
    ConfigError: for knobs the system cannot run.
  """
  values, system = peer.values, peer.system
  cluster = get_cluster(values["cluster"])
  profiles = tuner_profiles(values["model"], values["dataset"], values["batch_size"])
  costs = CostContext(values["weight_mode"], optimizer_slots(values["optimizer"]), precision=precision)
  common.progress("simulating the plan's %s: %s on %s, batch %d, %s", system, values["model"], cluster.name,
                  values["batch_size"], peer.knobs)
  run = get_system(system).simulate(cluster, profiles, values["batch_size"], peer.knobs, costs, values["model"])
  timeline_out = common.write_json(common.output_path(out_dir, f"{system}.timeline.json"), run.timeline,
                                   indent=None)
  summary = {"system": system, "model": values["model"], "cluster": values["cluster"], "executor": "sim",
             "batch_size": values["batch_size"], "knobs": peer.knobs._asdict(), "round_seconds": run.round_seconds,
             "examples_per_round": run.examples_per_round, "images_per_second": run.images_per_sec,
             "efficiency": run.efficiency, "precision": precision,
             "plan": {"path": peer.path, "entry": peer.entry, "predicted_images_per_sec": peer.predicted}}
  summary_out = common.write_json(common.output_path(out_dir, "summary.json"), summary)
  print(f"{system} ({peer.label}): one round {run.round_seconds * 1e3:.4g} ms for "
        f"{run.examples_per_round} examples on the simulated cluster time; ideal aggregate "
        f"{run.ideal_images_per_sec:,.1f} images/s")
  if peer.predicted:
    print(f"tuned plan {peer.path}: predicted {peer.predicted:,.1f} images/s, this run {run.images_per_sec:,.1f} "
          f"({run.images_per_sec / peer.predicted - 1:+.2%})")
  common.print_outputs([("timeline", timeline_out), ("summary", summary_out)])
  print(f"images_per_sec={run.images_per_sec:.6g} efficiency={run.efficiency:.4f}")


def apply_plan(flag_values: flags.FlagValues, best: dict) -> TunedPlan:
  """Sets the flags of ``--plan``'s HetPipe configuration ``best``; returns the plan (with ``time_model`` when
  the numerics train a small ``--model`` on the plan's full-size model's clock).

  Raises:
    ConfigError: for a plan that is not one, or a flag given beside it that disagrees with it.
  """
  fv, path = flag_values, flag_values.plan
  try:
    values = _plan_values(best, fv.dataset)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"--plan={path}: not a tuned plan ({type(e).__name__}: {e}); write one with python -m "
                      "experiments.tune") from None
  time_model = None
  if fv.executor != "sim" and values["model"] in FULL_SIZE:
    if not fv["model"].present or fv.model in FULL_SIZE:
      raise ConfigError(f"--plan={path} is for the full-size {values['model']}, which trains on no data here: "
                        f"simulate it (--executor=sim), or train a small model on its clock (e.g. --model=cnn)")
    time_model, values["model"] = values["model"], fv.model  # the numerics' model, the plan's clock
    values["dataset"] = fv.dataset
  for name, off in (("overlap_transfers", False), ("staged_ps", False), ("noise", "none")):  # the plan's sim options,
    if fv.executor != "sim" and values[name] != off:  # on an executor that computes
      print(f"note: the plan's {name} is a model of the sim executor; the {fv.executor} executor "
            f"{ELSEWHERE[name]}", flush=True)
      values[name] = off
  for name in PLAN_FLAGS:
    given = fv[name].value
    if fv[name].present and given != values[name]:
      shown = ",".join(given) if isinstance(given, list) else given
      want = ",".join(values[name]) if isinstance(values[name], list) else values[name]
      raise ConfigError(f"--{name}={shown} disagrees with --plan={path}, which sets {name}={want}; drop "
                        f"--{name} or tune again with it")
    fv[name].value = values[name]
  if not fv["waves"].present:
    fv.waves = int(best.get("waves", fv.waves))
  return TunedPlan(path, fv.plan_entry, best["images_per_sec"], best.get("waves"), time_model)


def check_process_flags(flag_values: flags.FlagValues) -> None:
  """Refuses multi-process flags that this run would not use, or that no job could have.

  Raises:
    ConfigError: for --process_id/--num_processes without --coordinator_address or a multiprocess
      executor, or for a process count below 1.
  """
  fv = flag_values
  given = [f"--{name}" for name in ("process_id", "num_processes", "coordinator_address") if fv[name].present]
  if given and fv.executor != "multiprocess":
    raise ConfigError(f"{', '.join(given)} join a multi-process job, but --executor={fv.executor}; use "
                      "--executor=multiprocess or drop them")
  if fv.num_processes is not None and fv.num_processes < 1:
    raise ConfigError(f"--num_processes={fv.num_processes}; a job has at least 1 process (one per node of "
                      "--cluster): drop it to let the launcher start them")
  if fv.coordinator_address is None and (fv.process_id is not None or fv.num_processes is not None):
    raise ConfigError("--process_id and --num_processes join a job through its coordinator: give "
                      "--coordinator_address=HOST:PORT too, or drop them to launch one process per node here")


LANGUAGE_MODELS = ("gpt", "gpt6")  # the small GPTs: --dataset=auto trains them on the text corpus, else on tokens


def model_and_data(name: str, dataset: str, seq_len: int | None, executor: str):
  """(the model, its dataset or, for a full-size model on the sim executor, its input description)."""
  if executor == "sim" and name in FULL_SIZE:  # no numerics: the model's own input, no data
    return full_size_model(name), full_size_spec(name, seq_len)
  if seq_len is not None:
    raise ConfigError(f"--seq_len={seq_len} sets a full-size GPT's sequence length in a simulation "
                      f"(--executor=sim --model=gpt2-xl|gpt-6.7b|gpt-13b); --model={name} on "
                      f"--executor={executor} takes its dataset's sequences: drop --seq_len")
  if dataset == "auto" and name in LANGUAGE_MODELS:
    dataset = "text" if text_installed() else "tokens"
    common.progress("--dataset=auto: %s trains on %s", name, dataset)
  data = load_dataset(dataset)
  return get_model(name, data.num_classes), data


def run(model, dataset, config: RunConfig, multiprocess: bool) -> RunResult:
  """``run_hetpipe``; in a multi-process job an unexpected error ends this process at once, in one line."""
  if not multiprocess:
    return run_hetpipe(model, dataset, config)
  node = current_node()
  try:
    return run_hetpipe(model, dataset, config)
  except Exception as e:  # one line, and out at once: the launcher stops the other processes
    if node is None or isinstance(e, (ConfigError, RunStopped)):
      raise
    node.abort(f"{type(e).__name__}: {e}")
    raise  # not reached: abort ends the process


CLOCKS = {"virtual": "emulated cluster time", "sim": "simulated cluster time", "wall": "wall time (CPU emulation)",
          "multiprocess": "wall time of process 0 (CPU emulation)"}


class Paths(NamedTuple):
  """Where a run writes (created only when it writes: a refused run leaves no folder)."""

  out_dir: str
  trace: str
  metrics: str

  def file(self, name: str) -> str:
    """``name`` in the output directory, its folder created."""
    return common.ensure_parent(os.path.join(self.out_dir, name))


class Ran(NamedTuple):
  """A finished run, as its outputs describe it.

  Attributes:
    model: the trained (or simulated) model.
    config: the config that ran (:func:`~hetpipe_jax.run.result.ran_config`: the planner's layout).
    result: what it left.
    policy: ``--policy`` as given (None: a manual layout).
    plan: the tuned plan it followed, if any.
    language: a language model's score (tokens, perplexity, the unigram baseline); None for another model.
  """

  model: Any
  config: RunConfig
  result: RunResult
  policy: str | None
  plan: TunedPlan | None
  language: LanguageScore | None


def rate_fields(ran: Ran) -> dict[str, Any]:
  """summary.json's throughput and quality: images/s and accuracy, or a language model's tokens/s (and what a token
  is) and perplexity with the unigram baseline's."""
  result, language = ran.result, ran.language
  if language is None:
    return {"images_per_second": result.images_per_second,
            "final_test_accuracy": result.metrics[-1].get("test_accuracy")}
  out = {"tokens_per_second": result.images_per_second * language.tokens_per_example, "token_unit": language.unit}
  if language.test_loss is not None:
    out.update(perplexity=language.perplexity, unigram_test_loss=language.unigram_loss,
               unigram_perplexity=language.unigram_perplexity)
  return out


def summarize(ran: Ran, violations, stats) -> dict:
  """summary.json of a run."""
  config, result = ran.config, ran.result
  meta = result.events[0]
  stages, nms = meta["stages"], meta["nm"]
  summary = {
      "model": ran.model.name, "dataset": meta["dataset"], "cluster": config.cluster,
      "executor": config.executor, "num_vws": len(stages), "stages": stages, "nm": nms,
      "window": meta.get("window") or nms, "d": config.wsp.d,
      "policy": ran.policy, "placement": config.layout.placement, "gpus": meta["gpus"],
      "cuts": result.cuts, "waves": config.waves, "batch_size": config.batch_size,
      "seconds": result.seconds, "host_seconds": result.wall_seconds, **rate_fields(ran),
      "trace_violations": [str(v) for v in violations[:20]], "staleness": stats,
      "checkpoints": result.checkpoints, "overlap_transfers": config.sim.overlap_transfers,
      "staged_ps": config.sim.staged_ps, "time_model": config.layout.time_model, "fast_sim": result.fast_sim,
      "precision": config.precision, "final_test_loss": result.metrics[-1].get("test_loss"),
      "skipped_steps": sum(ev.get("skipped", 0) for ev in result.events if ev["ev"] == "push"),
  }
  if ran.plan is not None:
    summary["plan"] = {"path": ran.plan.path, "entry": ran.plan.entry,
                       "predicted_images_per_sec": ran.plan.images_per_sec, "predicted_waves": ran.plan.waves}
  return summary


def write_pictures(ran: Ran, paths: Paths) -> list[tuple[str, str]]:
  """The training plot (with numerics), the Gantt chart of the first waves and the Chrome trace."""
  result, config = ran.result, ran.config
  meta = result.events[0]
  outputs = []
  if result.metrics[-1].get("test_loss") is not None:
    outputs.append(("plot", plot_training(
        result.metrics, paths.file("training.png"),
        f"{ran.model.name} on {meta['dataset']}, {len(meta['stages'])} VWs x {meta['stages']} stages, "
        f"Nm={meta['nm']}, D={config.wsp.d}, {config.executor} executor ({CLOCKS[config.executor]})", ran.language)))
  gantt_out = paths.file("timeline.png")
  plot_gantt(result.events, gantt_out, waves=3)
  chrome_out = common.write_json(paths.file("timeline.chrome.json"), chrome_trace(result.events), indent=None)
  return outputs + [("timeline", gantt_out), ("chrome", chrome_out)]


def headline(ran: Ran) -> str:
  """The run's first line: its final test accuracy (a language model's perplexity) and its rate."""
  result, language = ran.result, ran.language
  rate = result.images_per_second * (1 if language is None else language.tokens_per_example)
  rate_text = f"{rate:{',.0f' if rate >= 100 else '.3g'}} " + (
      "images/s" if language is None else "tokens/s" + (" (a token is a byte)" if language.unit == "bytes" else ""))
  final = result.metrics[-1].get("test_accuracy")
  if final is None:
    quality = "no numerics (sim)"
  elif language is None:
    quality = f"final test accuracy {final:.4f}"
  else:
    quality = f"final test perplexity {language.perplexity:.4g} per {language.unit[:-1]}"
  return (f"{quality} after {ran.config.waves} waves per virtual worker; {rate_text} on the "
          f"{CLOCKS[ran.config.executor]} ({result.seconds:.4g} s; host {result.wall_seconds:.1f} s)")


def report(ran: Ran, stats) -> None:
  """The run's lines on stdout: accuracy and rate (a language model's perplexity and tokens/s), fast-sim,
  staleness, plan, checkpoints."""
  config, result, language, plan = ran.config, ran.result, ran.language, ran.plan
  print(headline(ran))
  if language is not None and language.test_loss is not None:
    print(f"final test loss {language.test_loss:.4f} nats per {language.unit[:-1]}, perplexity "
          f"{language.perplexity:.4g} (unigram baseline: loss {language.unigram_loss:.4f}, perplexity "
          f"{language.unigram_perplexity:.4g})")
  if result.fast_sim is not None:
    print(f"fast sim ({result.fast_sim['method']}): simulated {max(result.fast_sim['simulated_waves'])} of "
          f"{config.waves} waves per virtual worker; the trace holds those")
  print(f"observed staleness: local max {max(stats['local_staleness'])} (bound "
        f"{max(stats['local_bound'])}), global max {stats['max_global_staleness']} (bound "
        f"{max(stats['global_bound'])}); blocked at the gate "
        f"{', '.join(f'{s:.3g}' for s in stats['blocked_seconds'])} s per VW")
  if plan is not None and config.executor == "sim" and plan.time_model is None:
    print(f"tuned plan {plan.path}: predicted {plan.images_per_sec:,.1f} images/s, this run "
          f"{result.images_per_second:,.1f} ({result.images_per_second / plan.images_per_sec - 1:+.2%})")
  if result.checkpoints is not None:
    ck = result.checkpoints
    resumed = "" if ck["resumed_from"] is None else f"resumed from global clock {ck['resumed_from']}; "
    cost = (f", {sum(ck['seconds']) / len(ck['seconds']):.3g} s and {ck['bytes'][-1] / 1e6:.3g} MB each"
            if ck["saved"] else "")
    print(f"checkpoints: {resumed}{ck['saved']} saved in {ck['directory']}{cost}")


def write_outputs(ran: Ran, paths: Paths) -> None:
  """Writes the metrics, the summary and the pictures, checks the trace, prints the report and the paths.

  Raises:
    SystemExit: when the trace breaks a WSP guarantee.
  """
  result = ran.result
  meta = result.events[0]
  splits = meta.get("tp") or [[[] for _ in group] for group in meta["gpus"]]  # tensor-parallel partners
  for i, (group, cut) in enumerate(zip(meta["gpus"], meta["cuts"])):
    stages = ["+".join([gpu, *partners]) for gpu, partners in zip(group, splits[i])]
    common.progress("virtual worker %d: Nm=%d, GPUs %s, cuts %s", i, meta["nm"][i], stages, cut)
  common.write_jsonl(common.ensure_parent(paths.metrics), result.metrics)
  violations = check_trace(result.events)
  stats = staleness_stats(as_version_1(result.events))  # (a trace of version 2 read in version 1)
  summary_out = common.write_json(paths.file("summary.json"), summarize(ran, violations, stats))
  outputs = [("trace", paths.trace), ("metrics", paths.metrics), ("summary", summary_out)]
  outputs += write_pictures(ran, paths)
  report(ran, stats)
  print("trace check: " + ("OK, every WSP guarantee holds" if not violations else
                           f"FAILED, {len(violations)} violations (see {summary_out})"))
  common.print_outputs(outputs)
  if violations:
    raise SystemExit(1)


def main(argv):
  del argv
  common.check_seed(FLAGS.seed)
  check_process_flags(FLAGS)
  if FLAGS["plan_entry"].present and not FLAGS.plan:
    raise ConfigError(f"--plan_entry={FLAGS.plan_entry} picks a configuration of a tuned plan; give "
                      "--plan=tune.json too, or drop it")
  entry = read_plan(FLAGS.plan, FLAGS.plan_entry) if FLAGS.plan else None
  if entry is not None and entry.get("system") not in (None, "hetpipe"):  # a peer's (a plan from before: HetPipe)
    return run_peer_plan(peer_plan(FLAGS, entry), FLAGS.precision, FLAGS.out_dir)
  plan = apply_plan(FLAGS, entry) if entry is not None else None
  multiprocess = FLAGS.executor == "multiprocess"
  paths = Paths(FLAGS.out_dir, FLAGS.trace_out or os.path.join(FLAGS.out_dir, "trace.jsonl"),
                FLAGS.metrics_out or os.path.join(FLAGS.out_dir, "metrics.jsonl"))
  config = run_flags.run_config(FLAGS, **run_flags.layout(FLAGS), trace_path=paths.trace,
                                time_model=plan.time_model if plan else None)
  if multiprocess and FLAGS.coordinator_address is None:
    return launch_nodes(config, FLAGS.job_timeout)
  if multiprocess:
    join_job(FLAGS.cluster, FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if not multiprocess:
    common.ensure_devices(run_flags.devices(config))
  model, dataset = model_and_data(FLAGS.model, FLAGS.dataset, FLAGS.seq_len, FLAGS.executor)
  common.progress("training %s on %s (%s executor%s)", model.name, getattr(dataset, "name", dataset),
                  config.executor, f", laid out by policy {FLAGS.policy}" if FLAGS.policy else "")
  result = run(model, dataset, config, multiprocess)
  if multiprocess and FLAGS.process_id != 0:
    return None  # process 0 runs the engine and writes every output
  ran = Ran(model, ran_config(config, result), result, FLAGS.policy, plan,
            language_score(dataset, result.metrics[-1].get("test_loss")))
  common.progress("ran %s", ran.config)
  return write_outputs(ran, paths)


cli = common.console(main)

if __name__ == "__main__":
  cli()
