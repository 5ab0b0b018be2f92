r"""Weak scaling on the simulated cluster: 16 to 1,024 heterogeneous GPUs (issue 12).

The clusters are ``mixed<N>x<G>`` (:func:`hetpipe_jax.cluster.mixed_cluster`): nodes of G GPUs of one
type, cycling through 8 types (TITAN V, TITAN RTX, RTX 2060, Quadro P4000, V100, A100, T4, RTX 3090),
PCIe inside a node and 56 Gb/s InfiniBand between nodes. For each model:

1. **Configuration.** At every size up to ``--base`` GPUs the tuner (:mod:`hetpipe_jax.tune`, at D = 0,
   transfers overlapped with computation, the placements of ``--placements``, the PS transfer models of
   ``--ps_transfers``) picks the grouping, the order, cuts and Nm of every virtual worker and the
   placement. A larger cluster runs the base size's tuned configuration replicated
   (:func:`hetpipe_jax.tune.replicate`: alike virtual workers get alike plans), the weak-scaling question
   being whether the same per-node work keeps its rate.
2. **Plan and simulate.** Each size is planned (replicated) and simulated for ``--waves`` waves per virtual
   worker with the ``sim`` executor's fast mode (:mod:`hetpipe_jax.sim.steady`: full event simulation until
   the waves settle, then extrapolated; ``python -m experiments.validate_fast`` checks it against full
   simulations), timed on the host; every simulated trace passes the WSP checker.
3. **Parameter server.** The same configuration is also simulated with one PS shard per unit on one node
   (``default`` placement) beside byte-range shards on every node (``striped``).

Writes scale.json / scale.csv (per model and size: GPUs, nodes, virtual workers, images or tokens per
second, the ideal heterogeneous aggregate and the efficiency against it, both placements, plan and
simulate seconds) and scale.png (throughput, efficiency and host seconds against GPUs), prints a table,
the paths, and as its last line ``plan_sim_seconds_1024=<s> efficiency_1024=<fraction>`` (the first model,
its largest size)::

  python -m experiments.scale
  python -m experiments.scale --models=resnet152 --sizes=16,64,256
"""

from __future__ import annotations

import dataclasses
import time

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["resnet152", "gpt2-xl"], "Full-size models (a CNN, or a GPT preset).")
flags.DEFINE_list("sizes", ["16", "32", "64", "128", "256", "512", "1024"], "Cluster sizes in GPUs.")
flags.DEFINE_integer("per_node", 8, "GPUs per node (all of one type).")
flags.DEFINE_integer("base", 64, "Largest size tuned directly; larger ones replicate its configuration.")
flags.DEFINE_list("placements", ["striped"], "PS placements the tuner searches (the study also simulates the "
                  "tuned configuration with striped and with default placement, for comparison).")
flags.DEFINE_list("ps_transfers", ["whole"], "PS transfer models the tuner searches: whole (a virtual worker's "
                  "push and pull as one), staged (each stage's part on its own), or both (slower to simulate at "
                  "scale: BUILD_NOTES.md, \"The scaling study\").")
flags.DEFINE_integer("batch_size", 32, "Images per minibatch of a CNN.")
flags.DEFINE_integer("gpt_batch_size", 8, "Sequences per minibatch of a GPT.")
flags.DEFINE_integer("gpt_seq_len", 1024, "Tokens per sequence of a GPT.")
flags.DEFINE_string("gpt_precision", "bf16", "Precision of a GPT: fp32, fp16 or bf16 (mixed precision: 16-bit "
                    "weights, activations and pushes, fp32 master weights on the PS).")
flags.DEFINE_integer("waves", 100, "Waves per virtual worker of every simulated run.")
flags.DEFINE_integer("tune_waves", 40, "Waves per virtual worker of the tuner's refining runs.")
flags.DEFINE_string("out_dir", "outputs/scale", "Where the JSON, CSV and chart go.")


@dataclasses.dataclass
class Row:
  model: str
  gpus: int
  nodes: int
  vws: int
  configuration: str
  placement: str
  items_per_sec: float  # images (CNN) or tokens (GPT) per second, with ``placement``
  ideal_items_per_sec: float
  items_per_sec_striped: float
  items_per_sec_per_unit: float  # one PS shard per unit, on one node (``default`` placement)
  plan_seconds: float
  sim_seconds: float
  simulated_waves: int
  fast_method: str
  setting: dict  # batch size, tokens per example, precision, and the configuration (tune.candidate_json)

  @property
  def efficiency(self) -> float:
    return self.items_per_sec / self.ideal_items_per_sec

  @property
  def plan_sim_seconds(self) -> float:
    return self.plan_seconds + self.sim_seconds


def simulate(cluster, profiles, candidate, placement: str, precision: str):
  """(minibatches per second, seconds taken, fast-mode info) of ``candidate`` simulated with the fast mode;
  its trace must pass the checker."""
  from hetpipe_jax.core.trace import Trace
  from hetpipe_jax.sim import simulate_fast
  trace = Trace()
  t0 = time.perf_counter()
  seconds, _, _, info = simulate_fast(candidate.job(cluster, profiles, FLAGS.waves, placement=placement,
                                                    precision=precision), trace)
  host = time.perf_counter() - t0
  common.require_wsp(trace.events, f"simulated run on {cluster.name}")
  return sum(candidate.layout.nms) * FLAGS.waves / seconds, host, info


def model_setting(model: str) -> tuple[int, int | None, str, float]:
  """(examples per minibatch, tokens per example or None, precision, optimizer slots) of a model in this
  study: a CNN trains in fp32 with momentum SGD (one parameter-sized slot), a GPT with Adam (two)."""
  from hetpipe_jax.models import FULL_SIZE
  if model not in FULL_SIZE:
    raise common.config_error(f"--models: {model!r} is not a full-size model; use one of {', '.join(FULL_SIZE)}")
  if model.startswith("gpt"):
    return FLAGS.gpt_batch_size, FLAGS.gpt_seq_len, FLAGS.gpt_precision, 2.0
  return FLAGS.batch_size, None, "fp32", 1.0


def study(model: str, sizes: list[int]) -> list[Row]:
  from hetpipe_jax.cluster import mixed_cluster
  from hetpipe_jax.cost.context import CostContext
  from hetpipe_jax.cost.profile import full_size_profiles
  from hetpipe_jax.plan.costmodel import ideal_images_per_sec
  from hetpipe_jax.tune import RunSetting, SearchSpace, TuneOptions, candidate_json, replicate, tune
  batch_size, seq_len, precision, slots = model_setting(model)
  setting = RunSetting(CostContext(optimizer_slots=slots, precision=precision))
  space = SearchSpace(ds=(0,), placements=tuple(FLAGS.placements), transfers=(True,),
                      staged=tuple(common.parse_ps_transfers(FLAGS.ps_transfers)))
  profiles = full_size_profiles(model, batch_size, seq_len=seq_len)
  items = batch_size * (seq_len or 1)  # images or tokens per minibatch
  tuned = {}
  for n in sorted({min(n, FLAGS.base) for n in sizes}):
    cluster = mixed_cluster(n, FLAGS.per_node)
    common.progress("%s: tuning on %s (%d GPUs)", model, cluster.name, n)
    out = tune(cluster, profiles, batch_size, space,
               TuneOptions(waves=FLAGS.tune_waves, refine=3, setting=setting,
                           progress=lambda line: common.progress("  %s", line)))
    tuned[n] = out.best.candidate
  rows = []
  for n in sizes:
    cluster = mixed_cluster(n, FLAGS.per_node)
    t0 = time.perf_counter()
    candidate = replicate(tuned[min(n, FLAGS.base)], cluster, profiles, setting=setting)
    plan_seconds = time.perf_counter() - t0
    rate, sim_seconds, info = simulate(cluster, profiles, candidate, candidate.placement, precision)
    by_placement = {candidate.placement: rate}
    for placement in ("striped", "default"):  # the comparison, whichever placement was tuned
      if placement not in by_placement:
        by_placement[placement] = simulate(cluster, profiles, candidate, placement, precision)[0]
    row = Row(model, n, cluster.num_nodes, len(candidate.plans), candidate.label, candidate.placement,
              rate * items,
              ideal_images_per_sec(cluster, profiles, batch_size, precision=precision) * items / batch_size,
              by_placement["striped"] * items, by_placement["default"] * items, plan_seconds,
              sim_seconds, max(info["simulated_waves"]), info["method"],
              {"batch_size": batch_size, "seq_len": seq_len, "precision": precision, "cluster": cluster.name,
               **candidate_json(candidate)})
    common.progress("%s on %s: %.0f per s, efficiency %.3f, planned and simulated in %.2f s (%s, %d waves)",
                    model, cluster.name, row.items_per_sec, row.efficiency, row.plan_sim_seconds,
                    info["method"], row.simulated_waves)
    rows.append(row)
  return rows


def chart(rows: list[Row], path: str) -> str:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for model in dict.fromkeys(r.model for r in rows):
    mine = [r for r in rows if r.model == model]
    gpus = [r.gpus for r in mine]
    axes[0].plot(gpus, [r.items_per_sec_striped for r in mine], "o-", label=f"{model} (striped PS)")
    axes[0].plot(gpus, [r.items_per_sec_per_unit for r in mine], "x:", label=f"{model} (a PS shard per unit)")
    axes[0].plot(gpus, [r.ideal_items_per_sec for r in mine], "--", alpha=0.5, label=f"{model} ideal aggregate")
    axes[1].plot(gpus, [r.efficiency for r in mine], "o-", label=model)
    axes[2].plot(gpus, [r.plan_sim_seconds for r in mine], "o-", label=model)
    axes[2].plot(gpus, [mine[-1].plan_sim_seconds * g / gpus[-1] for g in gpus], ":", alpha=0.5,
                 label=f"{model}: linear through the largest")
  for ax, ylabel in zip(axes, ["images or tokens per second", "efficiency (of the ideal aggregate)",
                               "plan + simulate (host s)"]):
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0].set_yscale("log")
  axes[2].set_yscale("log")
  axes[1].set_ylim(0, 1)
  fig.suptitle(f"Weak scaling on mixed clusters ({FLAGS.per_node} GPUs per node, 8 types), sim executor, "
               f"{FLAGS.waves} waves")
  return common.save_figure(fig, path)


def main(argv):
  del argv
  sizes = common.parse_ints("sizes", FLAGS.sizes)
  if any(n < 1 or n % FLAGS.per_node for n in sizes):
    raise common.config_error(f"--sizes={','.join(FLAGS.sizes)}: every size must be a positive multiple of "
                              f"--per_node={FLAGS.per_node}")
  if FLAGS.waves < 2 or FLAGS.tune_waves < 2:
    raise common.config_error(f"--waves={FLAGS.waves}, --tune_waves={FLAGS.tune_waves}: at least 2 each")
  common.parse_ps_transfers(FLAGS.ps_transfers)  # a bad value is refused before the study starts
  rows = [row for model in FLAGS.models for row in study(model, sizes)]
  fields = ["model", "gpus", "nodes", "vws", "placement", "items_per_sec", "ideal_items_per_sec", "efficiency",
            "items_per_sec_striped", "items_per_sec_per_unit", "plan_seconds", "sim_seconds", "plan_sim_seconds",
            "simulated_waves", "fast_method", "configuration"]
  docs = [{**{f: getattr(r, f) for f in fields}, "setting": r.setting} for r in rows]
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "scale.json"),
                               {"per_node": FLAGS.per_node, "waves": FLAGS.waves, "base": FLAGS.base,
                                "batch_size": FLAGS.batch_size, "rows": docs})
  csv_out = common.write_csv(common.output_path(FLAGS.out_dir, "scale.csv"), fields,
                             [[d[f] for f in fields] for d in docs])
  png_out = chart(rows, common.output_path(FLAGS.out_dir, "scale.png"))
  print(f"{'model':>12} {'GPUs':>5} {'VWs':>4} {'per s':>10} {'ideal':>10} {'eff.':>5} {'striped':>10} "
        f"{'per unit':>10} {'plan+sim s':>10}")
  for r in rows:
    print(f"{r.model:>12} {r.gpus:>5} {r.vws:>4} {r.items_per_sec:>10.0f} {r.ideal_items_per_sec:>10.0f} "
          f"{r.efficiency:>5.2f} {r.items_per_sec_striped:>10.0f} {r.items_per_sec_per_unit:>10.0f} "
          f"{r.plan_sim_seconds:>10.2f}")
  print("images (CNN) or tokens (GPT) per second of the simulated cluster; host seconds measured here")
  common.print_outputs([("json", json_out), ("csv", csv_out), ("chart", png_out)])
  last = [r for r in rows if r.model == FLAGS.models[0]][-1]
  print(f"plan_sim_seconds_{last.gpus}={last.plan_sim_seconds:.2f} efficiency_{last.gpus}={last.efficiency:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
