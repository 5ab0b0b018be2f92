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

import sys

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "Model: mlp, cnn, vgg, resnet, gpt (on --dataset=tokens or text); with "
                    "--executor=sim also the full-size vgg19, resnet152, gpt2-xl, gpt-6.7b, gpt-13b; or "
                    "package.module:factory, a function of yours that builds the model (hetpipe_jax.from_modules), "
                    "importable in every process (e.g. examples.residual_mlp:model).")
flags.DEFINE_string("dataset", "auto", "Dataset: auto (Fashion-MNIST, else digits), fashion_mnist, "
                    "digits, synthetic, tokens (a synthetic language for --model=gpt), text (English text "
                    "byte by byte for --model=gpt: Debian's fortunes, apt-get install -y fortunes).")
flags.DEFINE_integer("seq_len", None, "Full-size GPT models (sim): tokens per sequence (default: the context).")
flags.DEFINE_string("precision", "fp32", "fp32, bf16 or fp16: mixed precision (16-bit compute, activations and "
                    "pushes, fp32 master weights and optimizer state; fp16 with dynamic loss scaling) in the "
                    "training (virtual, wall, multiprocess) and in the cost and memory model.")
flags.DEFINE_string("cluster", "hetero4", "Cluster preset (hetero4, hetero4x4, uniform8, paper_testbed, "
                    "paper_half, paper_mini, v100_t4) or a .toml file.")
flags.DEFINE_string("policy", None, "Allocation policy NP, ED or HD (or a grouping '0,1;2,3'): the planner "
                    "then decides virtual workers, device order, cuts and Nm (--nm=max_fit|best|N).")
flags.DEFINE_string("placement", "default", "PS shard placement: default, local or striped (sim only).")
flags.DEFINE_integer("num_vws", 3, "Number of virtual workers N.")
flags.DEFINE_list("stages", ["2"], "Devices (stages) per virtual worker: one value, or one per VW.")
flags.DEFINE_list("nm", ["2"], "Minibatches per wave, and most in flight, per virtual worker (Nm >= 1): one, or "
                  "one per VW; with --policy also max_fit or best (default then: max_fit).")
flags.DEFINE_list("window", None, "Most minibatches in flight per virtual worker when fewer than Nm (1 <= "
                  "window <= Nm; memory grows with it, the wave stays Nm): one, or one per VW (default: Nm).")
flags.DEFINE_integer("d", 1, "Clock distance bound D >= 0.")
flags.DEFINE_integer("waves", 120, "Waves each virtual worker runs.")
flags.DEFINE_integer("batch_size", 32, "Examples per minibatch.")
flags.DEFINE_float("learning_rate", 0.05, "Local optimizer learning rate.")
flags.DEFINE_string("optimizer", "sgd", "Local optimizer: sgd, momentum, adam.")
flags.DEFINE_string("ps_optimizer", "add", "The parameter server's outer optimizer on each pushed wave's summed "
                    "update delta: add (default: W += delta), sgd:lr=X, momentum:lr=X,momentum=M, or "
                    "nesterov:lr=0.7,momentum=0.9 (DiLoCo's outer Nesterov step on -delta; no effect on the sim "
                    "executor, which has no numerics).")
flags.DEFINE_string("weight_mode", "stash", "stash (backward uses its forward's weights) or latest.")
flags.DEFINE_string("schedule", "1f1b", "Device task order: 1f1b (backward first), fifo, or gpipe (a wave's "
                    "forwards, then its backwards, flush between waves).")
flags.DEFINE_string("executor", "virtual", "virtual (emulated cluster clock, deterministic), wall, sim "
                    "(cost model with shared links, no numerics), or multiprocess (one process per node).")
flags.DEFINE_float("time_scale", 0.0, "wall executor: pad every task to its emulated duration x this "
                   "(0: no padding).")
flags.DEFINE_string("cuts", None, "Unit boundaries of each virtual worker's stages: one list for every VW, "
                    "e.g. '0,2,5', or one per VW separated by ';', e.g. '0,2,5;0,3,5'; without --stages they "
                    "also set the stages (default: the partitioner's fastest cuts for each VW's GPUs, taken "
                    "in cluster order).")
flags.DEFINE_integer("seed", 0, "Initialisation and shuffling seed, in [0, 2**63 - 1].")
flags.DEFINE_integer("eval_every", 10, "Evaluate test accuracy every this many global clock ticks.")
flags.DEFINE_enum("on_nonfinite", "stop", ["stop", "skip"], "A pushed update with NaN or Inf: stop the run "
                  "(one line: VW, wave, stage, unit, last good global clock) or skip (drop that wave's "
                  "update, note it in the trace, go on).")
flags.DEFINE_multi_string("fail", [], "Fault injection, VW@WAVE (repeatable): that virtual worker fails when "
                          "it reaches that wave; the others go on under WSP without it.")
flags.DEFINE_bool("rejoin", False, "A failed virtual worker is replaced at once: it pulls the global weights "
                  "and enters at the current global clock.")
flags.DEFINE_string("checkpoint_dir", None, "Save checkpoints here (orbax), every --checkpoint_every global "
                    "clock ticks; with --resume, continue the newest complete one (the executors with numerics).")
flags.DEFINE_integer("checkpoint_every", 10, "Global clock ticks between checkpoints.")
flags.DEFINE_integer("keep_checkpoints", 3, "How many of the newest checkpoints to keep.")
flags.DEFINE_bool("resume", False, "Continue the newest complete checkpoint in --checkpoint_dir, appending to "
                  "the same trace (what the interrupted run wrote after it is rolled back).")
flags.DEFINE_bool("drop_remainder", False, "Drop the examples of an epoch that do not fill a minibatch.")
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
flags.DEFINE_bool("overlap_transfers", False, "sim executor: a stage's input travels while its device computes "
                  "other tasks, instead of being received in series inside the task.")
flags.DEFINE_bool("staged_ps", False, "sim executor: each stage's part of a push leaves when that stage's last "
                  "backward of the wave ends, and each stage's part of a pull lands on its own (the gated "
                  "forwards wait at a stage for its part only), instead of a virtual worker's push and pull "
                  "moving as one.")
flags.DEFINE_bool("fast_sim", False, "sim executor: simulate until every virtual worker's wave period settles, "
                  "then extrapolate the rest of --waves (hetpipe_jax.sim.steady; checked by "
                  "experiments.validate_fast).")
flags.DEFINE_string("out_dir", "outputs/train", "Directory for every output.")
flags.DEFINE_string("trace_out", None, "Trace path (default: OUT_DIR/trace.jsonl).")
flags.DEFINE_string("metrics_out", None, "Metrics path (default: OUT_DIR/metrics.jsonl).")


def plot_training(metrics: list[dict], path: str, title: str) -> None:
  """Train loss per virtual worker and test accuracy of the global weights against time."""
  plt = common.pyplot()
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  for vw in sorted({r["vw"] for r in metrics}):
    rows = [r for r in metrics if r["vw"] == vw]
    ax_loss.plot([r["time"] for r in rows], [r["train_loss"] for r in rows], label=f"VW {vw}", lw=1)
  evals = [r for r in metrics if "test_accuracy" in r]
  ax_acc.plot([r["time"] for r in evals], [r["test_accuracy"] for r in evals], "o-", color="k")
  for ax, label in ((ax_loss, "train loss (per wave)"), (ax_acc, "test accuracy (global weights)")):
    ax.set_xlabel("time (s, executor clock)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_loss.legend()
  fig.suptitle(title, fontsize=9)
  common.save_figure(fig, path)


def parse_failures(values: list[str]) -> list[tuple[int, int]]:
  """``--fail`` values ``VW@WAVE`` as (virtual worker, wave) pairs."""
  out = []
  for value in values:
    vw, sep, wave = value.partition("@")
    if not sep or not vw.strip().isdigit() or not wave.strip().isdigit():
      raise common.config_error(f"--fail={value}; write VW@WAVE with two non-negative integers, e.g. "
                                "--fail=1@5")
    out.append((int(vw), int(wave)))
  return out


def launch_nodes() -> None:
  """``--executor=multiprocess`` without a coordinator: runs this command as one process per node of
  ``--cluster`` on this host (loopback) and waits for them; one failure or a hang ends all of them."""
  from hetpipe_jax import get_cluster
  from hetpipe_jax.runtime.launch import child_environment, free_port, launch
  nodes = sorted({g.node for g in get_cluster(FLAGS.cluster).gpus})
  coordinator = f"127.0.0.1:{free_port()}"
  cmd = [sys.executable, "-m", "experiments.train", *sys.argv[1:], f"--coordinator_address={coordinator}",
         f"--num_processes={len(nodes)}"]
  env = child_environment()
  common.progress("launching %d processes (one per node) on this host, coordinator %s", len(nodes), coordinator)
  result = launch([cmd + [f"--process_id={i}"] for i in range(len(nodes))], [env] * len(nodes),
                  FLAGS.job_timeout, grace_s=60, names=[f"node {n}" for n in nodes], survivable=True)
  if result.ok and result.lost:
    print(f"lost during the run: {'; '.join(result.lost)} (the job went on without them: see the trace's "
          "leave events)", flush=True)
  if not result.ok:  # a run that process 0 stopped on purpose has said why in one line already
    raise SystemExit(1 if result.stopped else f"error: {result.message}")


def join_job() -> None:
  """Joins the multi-process job as ``--process_id`` with the CPU devices of its node (before JAX starts)."""
  from hetpipe_jax import ConfigError, get_cluster
  from hetpipe_jax.runtime.distributed import join
  from hetpipe_jax.runtime.launch import check_port_free
  cluster = get_cluster(FLAGS.cluster)
  nodes = sorted({g.node for g in cluster.gpus})
  if FLAGS.num_processes != len(nodes):
    raise ConfigError(f"--num_processes={FLAGS.num_processes} but cluster {cluster.name!r} has {len(nodes)} "
                      f"nodes; run one process per node (--num_processes={len(nodes)})")
  if FLAGS.process_id is None or not 0 <= FLAGS.process_id < len(nodes):
    raise ConfigError(f"--process_id={FLAGS.process_id}; give each of the {len(nodes)} processes a distinct "
                      f"id in 0..{len(nodes) - 1}")
  if FLAGS.process_id == 0:
    check_port_free(FLAGS.coordinator_address)  # process 0 hosts the coordination service
  join(FLAGS.coordinator_address, len(nodes), FLAGS.process_id,
       local_devices=len(cluster.node_gpus(nodes[FLAGS.process_id])), recoverable=True)


# What a tuned plan sets (a flag given beside it must match).
PLAN_FLAGS = ("model", "dataset", "cluster", "batch_size", "optimizer", "weight_mode", "schedule", "policy",
              "cuts", "nm", "window", "d", "placement", "overlap_transfers", "staged_ps")


def _plan_values(path: str, best: dict) -> dict:
  """The flag values a tuned plan's best configuration sets."""
  return {
      "model": best["model"], "cluster": best["cluster"], "batch_size": int(best["batch_size"]),
      "optimizer": best["optimizer"], "weight_mode": best["weight_mode"], "schedule": best["schedule"],
      "policy": ";".join(",".join(map(str, g)) for g in best["policy"]),
      "cuts": ";".join(",".join(map(str, c)) for c in best["cuts"]), "nm": [str(n) for n in best["nm"]],
      "window": [str(n) for n in best.get("window", best["nm"])],
      "d": int(best["d"]), "placement": best["placement"], "overlap_transfers": bool(best["overlap_transfers"]),
      "staged_ps": bool(best.get("staged_ps", False)),
      "dataset": best.get("dataset") or FLAGS.dataset}  # a small model's plan was profiled on its dataset


def read_plan(path: str, entry: str) -> dict:
  """The ``entry`` configuration of the tuned plan ``path`` (``best`` or ``best_hetpipe``; a plan written before
  ``best_hetpipe`` existed serves it from its ``best``, HetPipe's then).

  Raises:
    ConfigError: for an unreadable plan, or one without that entry.
  """
  import json

  from hetpipe_jax import ConfigError
  from hetpipe_jax.tune.peers import HETPIPE, system_of
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


def run_peer_plan(path: str, entry: dict) -> None:
  """Simulates the peer a tuned plan's configuration names, with its knobs, on the sim executor: writes its
  timeline (``python -m hetpipe_jax.efficiency`` reads it) and a summary into --out_dir and prints its images/s
  and efficiency, last ``images_per_sec=<x> efficiency=<y>`` (examples/s, as the tuner ranks them).

  Raises:
    ConfigError: on another executor, for a flag given beside the plan that disagrees with it, or knobs the
      system cannot run.
  """
  from hetpipe_jax import ConfigError, get_cluster
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.optim import optimizer_slots
  from hetpipe_jax.systems import get_system
  from hetpipe_jax.tune.peers import peer_knobs, system_of, tuner_profiles
  system = system_of(entry)
  if FLAGS.executor != "sim":
    raise ConfigError(f"--plan={path}: a peer plan (system {system}) runs on the sim executor; train its numerics "
                      "with experiments.convergence")
  try:
    values = {"model": entry["model"], "dataset": entry.get("dataset") or FLAGS.dataset,
              "cluster": entry["cluster"], "batch_size": int(entry["batch_size"]),
              "optimizer": entry.get("optimizer", FLAGS.optimizer),
              "weight_mode": entry.get("weight_mode", FLAGS.weight_mode)}
    knobs = peer_knobs(entry)
  except ConfigError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise ConfigError(f"--plan={path}: not a tuned plan ({type(e).__name__}: {e}); write one with python -m "
                      "experiments.tune") from None
  for name in PEER_PLAN_FLAGS:
    if FLAGS[name].present and FLAGS[name].value != values[name]:
      raise ConfigError(f"--{name}={FLAGS[name].value} disagrees with --plan={path}, which sets "
                        f"{name}={values[name]}; drop --{name} or tune again with it")
  cluster = get_cluster(values["cluster"])
  profiles = tuner_profiles(values["model"], values["dataset"], values["batch_size"])
  costs = CostContext(values["weight_mode"], optimizer_slots(values["optimizer"]), precision=FLAGS.precision)
  common.progress("simulating the plan's %s: %s on %s, batch %d, %s", system, values["model"], cluster.name,
                  values["batch_size"], knobs)
  run = get_system(system).simulate(cluster, profiles, values["batch_size"], knobs, costs, values["model"])
  timeline_out = common.write_json(common.output_path(FLAGS.out_dir, f"{system}.timeline.json"), run.timeline,
                                   indent=None)
  predicted = entry.get("images_per_sec")
  summary = {"system": system, "model": values["model"], "cluster": values["cluster"], "executor": "sim",
             "batch_size": values["batch_size"], "knobs": knobs._asdict(), "round_seconds": run.round_seconds,
             "examples_per_round": run.examples_per_round, "images_per_second": run.images_per_sec,
             "efficiency": run.efficiency, "precision": FLAGS.precision,
             "plan": {"path": path, "entry": FLAGS.plan_entry, "predicted_images_per_sec": predicted}}
  summary_out = common.write_json(common.output_path(FLAGS.out_dir, "summary.json"), summary)
  print(f"{system} ({entry.get('label', system)}): one round {run.round_seconds * 1e3:.4g} ms for "
        f"{run.examples_per_round} examples on the simulated cluster time; ideal aggregate "
        f"{run.ideal_images_per_sec:,.1f} images/s")
  if predicted:
    print(f"tuned plan {path}: predicted {predicted:,.1f} images/s, this run {run.images_per_sec:,.1f} "
          f"({run.images_per_sec / predicted - 1:+.2%})")
  common.print_outputs([("timeline", timeline_out), ("summary", summary_out)])
  print(f"images_per_sec={run.images_per_sec:.6g} efficiency={run.efficiency:.4f}")


def apply_plan(path: str, best: dict) -> dict | None:
  """Sets the flags of a tuned plan's HetPipe configuration ``best`` (read from ``path``); returns it (with
  ``time_model`` when the numerics train a small ``--model`` on the plan's full-size model's clock).

  Raises:
    ConfigError: for a plan that is not one, or a flag given beside it that disagrees with it.
  """
  from hetpipe_jax import ConfigError
  from hetpipe_jax.models import FULL_SIZE
  from hetpipe_jax.sim.options import ELSEWHERE
  try:
    values = _plan_values(path, best)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"--plan={path}: not a tuned plan ({type(e).__name__}: {e}); write one with python -m "
                      "experiments.tune") from None
  time_model = None
  if FLAGS.executor != "sim" and values["model"] in FULL_SIZE:
    if not FLAGS["model"].present or FLAGS.model in FULL_SIZE:
      raise ConfigError(f"--plan={path} is for the full-size {values['model']}, which trains on no data here: "
                        f"simulate it (--executor=sim), or train a small model on its clock (e.g. --model=cnn)")
    time_model, values["model"] = values["model"], FLAGS.model  # the numerics' model, the plan's clock
    values["dataset"] = FLAGS.dataset
  for name in ("overlap_transfers", "staged_ps"):  # the plan's sim options, on an executor that computes
    if FLAGS.executor != "sim" and values[name]:
      print(f"note: the plan's {name} is a model of the sim executor; the {FLAGS.executor} executor "
            f"{ELSEWHERE[name]}", flush=True)
      values[name] = False
  for name in PLAN_FLAGS:
    given = FLAGS[name].value
    if FLAGS[name].present and given != values[name]:
      shown = ",".join(given) if isinstance(given, list) else given
      want = ",".join(values[name]) if isinstance(values[name], list) else values[name]
      raise ConfigError(f"--{name}={shown} disagrees with --plan={path}, which sets {name}={want}; drop "
                        f"--{name} or tune again with it")
    FLAGS[name].value = values[name]
  if not FLAGS["waves"].present:
    FLAGS.waves = int(best.get("waves", FLAGS.waves))
  return {**best, "time_model": time_model}


def check_process_flags() -> None:
  """Refuses multi-process flags that this run would not use, or that no job could have.

  Raises:
    ConfigError: for --process_id/--num_processes without --coordinator_address or a multiprocess
      executor, or for a process count below 1.
  """
  from hetpipe_jax import ConfigError
  given = [f"--{name}" for name in ("process_id", "num_processes", "coordinator_address") if FLAGS[name].present]
  if given and FLAGS.executor != "multiprocess":
    raise ConfigError(f"{', '.join(given)} join a multi-process job, but --executor={FLAGS.executor}; use "
                      "--executor=multiprocess or drop them")
  if FLAGS.num_processes is not None and FLAGS.num_processes < 1:
    raise ConfigError(f"--num_processes={FLAGS.num_processes}; a job has at least 1 process (one per node of "
                      "--cluster): drop it to let the launcher start them")
  if FLAGS.coordinator_address is None and (FLAGS.process_id is not None or FLAGS.num_processes is not None):
    raise ConfigError("--process_id and --num_processes join a job through its coordinator: give "
                      "--coordinator_address=HOST:PORT too, or drop them to launch one process per node here")


def planned_shape(policy) -> tuple[object, list[list[int]] | None]:
  """(Nm, cuts) of a run whose ``--policy`` lets the planner lay it out (a grouping with ``--cuts`` is an
  explicit layout, cut as given).

  Raises:
    ConfigError: for flags the planner would override.
  """
  from hetpipe_jax import ConfigError
  given = [f"--{name}" for name in ("num_vws", "stages") if FLAGS[name].present]
  if isinstance(policy, str) and FLAGS.cuts:
    given.append("--cuts")
  if given:
    raise ConfigError(f"--policy={FLAGS.policy} lets the planner choose the virtual workers, their stages "
                      f"and cuts; drop {', '.join(given)} (a grouping of GPU indices with --cuts is taken as "
                      "given)")
  if FLAGS.cuts:  # a grouping in pipeline order, cut as given: an explicit layout (a tuned plan)
    nms = common.parse_ints("nm", FLAGS.nm)
    return (nms[0] if len(nms) == 1 else nms), common.parse_cuts(FLAGS.cuts, len(policy))
  if len(FLAGS.nm) > 1 and isinstance(policy, str):
    raise ConfigError(f"--nm={','.join(FLAGS.nm)} gives one Nm per virtual worker, but with --policy the "
                      "planner decides the virtual workers; give one value: a number, max_fit or best")
  if len(FLAGS.nm) > 1:
    return common.parse_ints("nm", FLAGS.nm), None
  nm_rule = FLAGS.nm[0] if FLAGS["nm"].present else "max_fit"
  return (nm_rule if nm_rule in ("max_fit", "best") else common.parse_ints("nm", FLAGS.nm)[0]), None


def run_shape(multiprocess: bool) -> dict:
  """The layout flags of the run as RunConfig fields (and the CPU devices it needs, for one process)."""
  from hetpipe_jax import get_cluster
  from hetpipe_jax.plan.allocation import parse_policy
  policy = parse_policy(FLAGS.policy) if FLAGS.policy else None
  stages = common.parse_ints("stages", FLAGS.stages)
  if policy is not None:
    nm, cuts = planned_shape(policy)
    devices = get_cluster(FLAGS.cluster).num_gpus
  else:
    nms = common.parse_ints("nm", FLAGS.nm)
    nm, cuts = (nms[0] if len(nms) == 1 else nms), None
    if FLAGS.cuts:
      cuts = common.parse_cuts(FLAGS.cuts, FLAGS.num_vws)
      if not FLAGS["stages"].present:  # the cuts say how many stages
        stages = [len(c) - 1 for c in cuts]
        stages = stages[:1] if len(set(stages)) == 1 else stages
    devices = FLAGS.num_vws * max(stages)
  if not multiprocess:
    common.ensure_devices(devices)
  window = common.parse_ints("window", FLAGS.window) if FLAGS.window else None
  return dict(num_vws=FLAGS.num_vws, stages=stages[0] if len(stages) == 1 else stages, nm=nm, cuts=cuts,
              window=window[0] if window and len(window) == 1 else window, policy=policy)


def make_config(shape: dict, trace_out: str, time_model: str | None):
  """The RunConfig of the flags."""
  from hetpipe_jax import RunConfig
  return RunConfig.of(
      **shape, cluster=FLAGS.cluster, d=FLAGS.d, waves=FLAGS.waves, batch_size=FLAGS.batch_size,
      optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate, ps_optimizer=FLAGS.ps_optimizer,
      weight_mode=FLAGS.weight_mode,
      schedule=FLAGS.schedule, executor=FLAGS.executor, time_scale=FLAGS.time_scale, seed=FLAGS.seed,
      eval_every=FLAGS.eval_every, drop_remainder=FLAGS.drop_remainder, trace_path=trace_out,
      placement=FLAGS.placement, on_nonfinite=FLAGS.on_nonfinite, checkpoint_dir=FLAGS.checkpoint_dir,
      checkpoint_every=FLAGS.checkpoint_every, keep_checkpoints=FLAGS.keep_checkpoints, resume=FLAGS.resume,
      failures=parse_failures(FLAGS.fail), rejoin=FLAGS.rejoin, overlap_transfers=FLAGS.overlap_transfers,
      staged_ps=FLAGS.staged_ps, fast_sim=FLAGS.fast_sim, time_model=time_model, precision=FLAGS.precision)


def model_and_data():
  """(the model, its dataset or, for a full-size model on the sim executor, its input description)."""
  from hetpipe_jax import ConfigError, get_model, load_dataset
  from hetpipe_jax.models import FULL_SIZE, full_size_model, full_size_spec
  if FLAGS.executor == "sim" and FLAGS.model in FULL_SIZE:  # no numerics: the model's own input, no data
    return full_size_model(FLAGS.model), full_size_spec(FLAGS.model, FLAGS.seq_len)
  if FLAGS.seq_len is not None:
    raise ConfigError(f"--seq_len={FLAGS.seq_len} sets a full-size GPT's sequence length in a simulation "
                      f"(--executor=sim --model=gpt2-xl|gpt-6.7b|gpt-13b); --model={FLAGS.model} on "
                      f"--executor={FLAGS.executor} takes its dataset's sequences: drop --seq_len")
  dataset = load_dataset(FLAGS.dataset)
  return get_model(FLAGS.model, dataset.num_classes), dataset


def run(model, dataset, config, multiprocess: bool):
  """``run_hetpipe``; in a multi-process job an unexpected error ends this process at once, in one line."""
  from hetpipe_jax import ConfigError, run_hetpipe
  from hetpipe_jax.errors import RunStopped
  if not multiprocess:
    return run_hetpipe(model, dataset, config)
  from hetpipe_jax.runtime.distributed import current_node
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


def summarize(model, config, result, violations, stats, plan) -> dict:
  """summary.json of a run."""
  meta = result.events[0]
  stages, nms = meta["stages"], meta["nm"]
  summary = {
      "model": model.name, "dataset": meta["dataset"], "cluster": config.cluster,
      "executor": config.executor, "num_vws": len(stages), "stages": stages, "nm": nms,
      "window": meta.get("window") or nms, "d": config.wsp.d,
      "policy": FLAGS.policy, "placement": FLAGS.placement, "gpus": meta["gpus"],
      "cuts": result.cuts, "waves": config.waves, "batch_size": config.batch_size,
      "seconds": result.seconds, "host_seconds": result.wall_seconds,
      "images_per_second": result.images_per_second, "final_test_accuracy": result.metrics[-1].get("test_accuracy"),
      "trace_violations": [str(v) for v in violations[:20]], "staleness": stats,
      "checkpoints": result.checkpoints, "overlap_transfers": config.sim.overlap_transfers,
      "staged_ps": config.sim.staged_ps, "time_model": config.layout.time_model, "fast_sim": result.fast_sim,
      "precision": config.precision, "final_test_loss": result.metrics[-1].get("test_loss"),
      "skipped_steps": sum(ev.get("skipped", 0) for ev in result.events if ev["ev"] == "push"),
  }
  if plan is not None:
    summary["plan"] = {"path": FLAGS.plan, "entry": FLAGS.plan_entry,
                       "predicted_images_per_sec": plan["images_per_sec"], "predicted_waves": plan.get("waves")}
  return summary


def write_pictures(model, config, result) -> list[tuple[str, str]]:
  """The training plot (with numerics), the Gantt chart of the first waves and the Chrome trace."""
  from hetpipe_jax.viz.timeline import chrome_trace, plot_gantt
  meta = result.events[0]
  outputs = []
  if result.metrics[-1].get("test_accuracy") is not None:
    outputs.append(("plot", common.output_path(FLAGS.out_dir, "training.png")))
    plot_training(result.metrics, outputs[-1][1],
                  f"{model.name} on {meta['dataset']}, {len(meta['stages'])} VWs x {meta['stages']} stages, "
                  f"Nm={meta['nm']}, D={config.wsp.d}, {config.executor} executor ({CLOCKS[config.executor]})")
  gantt_out = common.output_path(FLAGS.out_dir, "timeline.png")
  plot_gantt(result.events, gantt_out, waves=3)
  chrome_out = common.write_json(common.output_path(FLAGS.out_dir, "timeline.chrome.json"),
                                 chrome_trace(result.events), indent=None)
  return outputs + [("timeline", gantt_out), ("chrome", chrome_out)]


def language_metrics(dataset, result) -> dict:
  """A language model's (labels: the next tokens) final test loss per token, its perplexity and the unigram
  baseline's (the training set's token frequencies); empty for any other run."""
  import math

  from hetpipe_jax.evaluate import unigram_loss
  labels = getattr(dataset, "y_train", None)
  loss = result.metrics[-1].get("test_loss")
  if labels is None or labels.ndim != 2 or loss is None:
    return {}
  baseline = unigram_loss(dataset)
  return {"final_test_loss": loss, "final_test_perplexity": math.exp(loss), "unigram_test_loss": baseline,
          "unigram_test_perplexity": math.exp(baseline)}


def report(config, result, stats, plan, language: dict) -> None:
  """The run's lines on stdout: accuracy and rate (a language model's perplexity), fast-sim, staleness, plan,
  checkpoints."""
  final_acc = result.metrics[-1].get("test_accuracy")
  rate = result.images_per_second  # a GPT's: sequences per second
  accuracy = "no numerics (sim)" if final_acc is None else f"final test accuracy {final_acc:.4f}"
  print(f"{accuracy} after {config.waves} waves per virtual worker; "
        f"{rate:{',.0f' if rate >= 100 else '.3g'}} images/s on the {CLOCKS[config.executor]} "
        f"({result.seconds:.4g} s; host {result.wall_seconds:.1f} s)")
  if language:
    print(f"final test loss {language['final_test_loss']:.4f} per token, perplexity "
          f"{language['final_test_perplexity']:.4g} (unigram baseline: loss {language['unigram_test_loss']:.4f}, "
          f"perplexity {language['unigram_test_perplexity']:.4g})")
  if result.fast_sim is not None:
    print(f"fast sim ({result.fast_sim['method']}): simulated {max(result.fast_sim['simulated_waves'])} of "
          f"{config.waves} waves per virtual worker; the trace holds those")
  print(f"observed staleness: local max {max(stats['local_staleness'])} (bound "
        f"{max(stats['local_bound'])}), global max {stats['max_global_staleness']} (bound "
        f"{max(stats['global_bound'])}); blocked at the gate "
        f"{', '.join(f'{s:.3g}' for s in stats['blocked_seconds'])} s per VW")
  if plan is not None and config.executor == "sim" and plan["time_model"] is None:
    print(f"tuned plan {FLAGS.plan}: predicted {plan['images_per_sec']:,.1f} images/s, this run "
          f"{result.images_per_second:,.1f} ({result.images_per_second / plan['images_per_sec'] - 1:+.2%})")
  if result.checkpoints is not None:
    ck = result.checkpoints
    resumed = "" if ck["resumed_from"] is None else f"resumed from global clock {ck['resumed_from']}; "
    cost = (f", {sum(ck['seconds']) / len(ck['seconds']):.3g} s and {ck['bytes'][-1] / 1e6:.3g} MB each"
            if ck["saved"] else "")
    print(f"checkpoints: {resumed}{ck['saved']} saved in {ck['directory']}{cost}")


def main(argv):
  del argv
  from hetpipe_jax import check_trace, staleness_stats
  common.check_seed(FLAGS.seed)
  check_process_flags()
  if FLAGS["plan_entry"].present and not FLAGS.plan:
    raise common.config_error(f"--plan_entry={FLAGS.plan_entry} picks a configuration of a tuned plan; give "
                              "--plan=tune.json too, or drop it")
  entry = read_plan(FLAGS.plan, FLAGS.plan_entry) if FLAGS.plan else None
  if entry is not None and entry.get("system") not in (None, "hetpipe"):  # a peer's (a plan from before: HetPipe)
    return run_peer_plan(FLAGS.plan, entry)
  plan = apply_plan(FLAGS.plan, entry) if entry is not None else None
  multiprocess = FLAGS.executor == "multiprocess"
  if multiprocess and FLAGS.coordinator_address is None:
    return launch_nodes()
  if multiprocess:
    join_job()
  shape = run_shape(multiprocess)
  trace_out = common.output_path(FLAGS.out_dir, "trace.jsonl", FLAGS.trace_out)
  metrics_out = common.output_path(FLAGS.out_dir, "metrics.jsonl", FLAGS.metrics_out)
  config = make_config(shape, trace_out, plan["time_model"] if plan else None)
  model, dataset = model_and_data()
  common.progress("training %s on %s: %s", model.name, getattr(dataset, "name", dataset), config)
  result = run(model, dataset, config, multiprocess)
  if multiprocess and FLAGS.process_id != 0:
    return None  # process 0 runs the engine and writes every output
  meta = result.events[0]
  for i, (group, cut) in enumerate(zip(meta["gpus"], meta["cuts"])):
    common.progress("virtual worker %d: Nm=%d, GPUs %s, cuts %s", i, meta["nm"][i], group, cut)
  common.write_jsonl(metrics_out, result.metrics)
  violations = check_trace(result.events)
  stats = staleness_stats(result.events)
  language = language_metrics(dataset, result)
  summary_out = common.write_json(common.output_path(FLAGS.out_dir, "summary.json"),
                                  {**summarize(model, config, result, violations, stats, plan), **language})
  outputs = [("trace", trace_out), ("metrics", metrics_out), ("summary", summary_out)]
  outputs += write_pictures(model, config, result)
  report(config, result, stats, plan, language)
  print("trace check: " + ("OK, every WSP guarantee holds" if not violations else
                           f"FAILED, {len(violations)} violations (see {summary_out})"))
  common.print_outputs(outputs)
  if violations:
    raise SystemExit(1)


cli = common.console(main)

if __name__ == "__main__":
  cli()
