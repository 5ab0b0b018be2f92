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
second, the ideal heterogeneous aggregate and the efficiency against it, both placements, the host seconds of
planning, simulating and checking, and of the whole row) and scale.png (throughput, efficiency and host seconds
per part against GPUs, with fitted exponents), prints a table, the paths, and as its last line
``plan_sim_seconds_<N>=<s> efficiency_<N>=<fraction>`` (the first model, its largest size N; the whole row)::

  python -m experiments.scale
  python -m experiments.scale --models=resnet152 --sizes=16,64,256
"""

from __future__ import annotations

from absl import flags

from experiments import common
from hetpipe_jax.studies.scale import FIELDS, PARTS, SIZES, ScaleConfig, ScaleRow, growth_exponent, row_json, run_scale

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(ScaleConfig.models), "Full-size models (a CNN, or a GPT preset).")
flags.DEFINE_list("sizes", [str(n) for n in SIZES], "Cluster sizes in GPUs.")
flags.DEFINE_integer("per_node", ScaleConfig.per_node, "GPUs per node (all of one type).")
flags.DEFINE_integer("base", ScaleConfig.base, "Largest size tuned directly; larger ones replicate its configuration.")
flags.DEFINE_list("placements", list(ScaleConfig.placements), "PS placements the tuner searches (the study also "
                  "simulates the tuned configuration with striped and with default placement, for comparison).")
flags.DEFINE_list("ps_transfers", [k for k, v in common.PS_TRANSFERS.items() if v in ScaleConfig.staged],
                  "PS transfer models the tuner searches: whole (a virtual worker's push and pull as one), staged "
                  "(each stage's part on its own), or both (slower to simulate at scale: BUILD_NOTES.md, \"The "
                  "scaling study\").")
flags.DEFINE_integer("batch_size", ScaleConfig.batch_size, "Images per minibatch of a CNN.")
flags.DEFINE_integer("gpt_batch_size", ScaleConfig.gpt_batch_size, "Sequences per minibatch of a GPT.")
flags.DEFINE_integer("gpt_seq_len", ScaleConfig.gpt_seq_len, "Tokens per sequence of a GPT.")
flags.DEFINE_string("gpt_precision", ScaleConfig.gpt_precision, "Precision of a GPT: fp32, fp16 or bf16 (mixed "
                    "precision: 16-bit weights, activations and pushes, fp32 master weights on the PS).")
flags.DEFINE_integer("waves", ScaleConfig.waves, "Waves per virtual worker of every simulated run.")
flags.DEFINE_integer("tune_waves", ScaleConfig.tune_waves, "Waves per virtual worker of the tuner's refining runs.")
flags.DEFINE_integer("jobs", ScaleConfig.jobs, "How many of a row's simulations (and their checks) run side by side, "
                     "each in a process of its own (0: one per core; 1: one after another).")
flags.DEFINE_string("out_dir", "outputs/scale", "Where the JSON, CSV and chart go.")


def config_from_flags() -> ScaleConfig:
  """The study's configuration from the flags (a bad value: one ConfigError line naming it)."""
  return ScaleConfig(models=tuple(FLAGS.models), sizes=tuple(common.parse_ints("sizes", FLAGS.sizes)),
                     per_node=FLAGS.per_node, base=FLAGS.base, placements=tuple(FLAGS.placements),
                     staged=tuple(common.parse_ps_transfers(FLAGS.ps_transfers)), batch_size=FLAGS.batch_size,
                     gpt_batch_size=FLAGS.gpt_batch_size, gpt_seq_len=FLAGS.gpt_seq_len,
                     gpt_precision=FLAGS.gpt_precision, waves=FLAGS.waves, tune_waves=FLAGS.tune_waves,
                     jobs=FLAGS.jobs)


def chart(rows: list[ScaleRow], config: ScaleConfig, path: str) -> str:
  """scale.png: throughput, efficiency and host seconds against GPUs, a line per model."""
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for model in dict.fromkeys(r.model for r in rows):
    mine = [r for r in rows if r.model == model]
    gpus = [r.gpus for r in mine]
    axes[0].plot(gpus, [r.items_per_sec_striped for r in mine], "o-", label=f"{model} (striped PS)")
    axes[0].plot(gpus, [r.items_per_sec_per_unit for r in mine], "x:", label=f"{model} (a PS shard per unit)")
    axes[0].plot(gpus, [r.ideal_items_per_sec for r in mine], "--", alpha=0.5, label=f"{model} ideal aggregate")
    axes[1].plot(gpus, [r.efficiency for r in mine], "o-", label=model)
    for part, style in zip(PARTS, ("s:", "^-", "v-", "o-")):
      seconds = [getattr(r, part) for r in mine]
      b = growth_exponent(gpus, seconds)
      axes[2].plot(gpus, seconds, style, label=f"{model} {part.split('_')[0]}" + ("" if b is None else f" (N^{b:.2f})"))
  for ax, ylabel in zip(axes, ["images or tokens per second", "efficiency (of the ideal aggregate)",
                               "host seconds per row, by part (fitted exponent)"]):
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0].set_yscale("log")
  axes[2].set_yscale("log")
  axes[1].set_ylim(0, 1)
  fig.suptitle(f"Weak scaling on mixed clusters ({config.per_node} GPUs per node, 8 types), sim executor, "
               f"{config.waves} waves")
  return common.save_figure(fig, path)


def print_table(rows: list[ScaleRow]) -> None:
  print(f"{'model':>12} {'GPUs':>5} {'VWs':>4} {'per s':>10} {'ideal':>10} {'eff.':>5} {'striped':>10} "
        f"{'per unit':>10} {'plan s':>7} {'sim s':>7} {'check s':>7} {'row s':>7}")
  for r in rows:
    print(f"{r.model:>12} {r.gpus:>5} {r.vws:>4} {r.items_per_sec:>10.0f} {r.ideal_items_per_sec:>10.0f} "
          f"{r.efficiency:>5.2f} {r.items_per_sec_striped:>10.0f} {r.items_per_sec_per_unit:>10.0f} "
          + " ".join(f"{getattr(r, part):>7.2f}" for part in PARTS))
  for model in dict.fromkeys(r.model for r in rows):
    mine = [r for r in rows if r.model == model]
    fits = {part: growth_exponent([r.gpus for r in mine], [getattr(r, part) for r in mine]) for part in PARTS}
    print(f"{model}: host seconds grow as GPUs^b, b = " + ", ".join(
        f"{part.split('_')[0]} {'-' if b is None else f'{b:.2f}'}" for part, b in fits.items()))
  print("images (CNN) or tokens (GPT) per second of the simulated cluster; host seconds measured here (a row: "
        "planning, the simulations of its placement, striped and default, and the checks of their traces; sim and "
        "check summed over the simulations, which run side by side with --jobs other than 1)")


def main(argv):
  del argv
  config = config_from_flags()
  rows = run_scale(config)
  docs = [row_json(r) for r in rows]
  json_out = common.write_json(common.output_path(FLAGS.out_dir, "scale.json"),
                               {"per_node": config.per_node, "waves": config.waves, "base": config.base,
                                "batch_size": config.batch_size, "rows": docs})
  csv_out = common.write_csv(common.output_path(FLAGS.out_dir, "scale.csv"), FIELDS,
                             [[d[f] for f in FIELDS] for d in docs])
  png_out = chart(rows, config, common.output_path(FLAGS.out_dir, "scale.png"))
  print_table(rows)
  common.print_outputs([("json", json_out), ("csv", csv_out), ("chart", png_out)])
  last = [r for r in rows if r.model == config.models[0]][-1]
  print(f"plan_sim_seconds_{last.gpus}={last.plan_sim_seconds:.2f} efficiency_{last.gpus}={last.efficiency:.3f}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
