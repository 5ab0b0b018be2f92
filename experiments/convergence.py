r"""Convergence study: HetPipe (NP, ED, HD, the tuned configuration, and the tuned one with an outer optimizer
at the parameter server) against its peers (Horovod, heterogeneity-aware data parallelism, synchronous
heterogeneous pipelines, local SGD / DiLoCo) in time to accuracy.

Real training (real gradients, the MLP on Fashion-MNIST by default) on the emulated cluster's clock. The time axis is
the cost of --time_model (VGG-19 by default) on --cluster; "none" times the trained model's own cost. Every
run trains the same model from the same initialisation on the same examples (--epochs of them), once per
seed of --seeds:

* HetPipe with each allocation policy of --policies at each D of --ds (partitions and Nm from the planner),
  and the tuned configuration (``experiments.tune``'s search on the time model), chosen by measurement
  (--tuned_objective=measured, the default: --pilots configurations of the tuner's front of images/s against
  staleness trained on --pilot_seed, the first to the target kept), or by its predicted time to accuracy
  with the staleness model fitted to the first seed's HetPipe runs (images/s when they give no fit); with
  --outer, the tuned configuration again with the best of those outer rules at the parameter server
  (``--ps_optimizer``: WSP with long waves as asynchronous local SGD), measured again under that rule. They
  train on the ``virtual`` executor, whose clock is scaled so that each configuration's images/s equal the
  ``sim`` executor's;
* every peer of --systems (:mod:`hetpipe_jax.baselines`), simulated on the same network and cost model
  (its round's seconds are its clock) and trained with its own numerics: horovod, hetero_dp and
  sync_pipeline as synchronous SGD at their global batch with each worker's gradient weighted by its share,
  local_sgd with its H and outer Nesterov step (--local_steps, --h_by_speed, --outer_lr, --outer_momentum);
* with --ssp, an SSP parameter server without pipelining (one worker per GPU, Nm = 1, D = --ssp_d).

Learning rates, the same search for every system (:mod:`hetpipe_jax.studies.convergence_lr`): the rule's rate
is --base_lr (0.02) per 32-example update, scaled linearly (--lr_scaling=sqrt: with the square root, for Adam)
with the examples behind one update (a synchronous peer's global batch; HetPipe's and local SGD's local step of
one minibatch). Each system (every peer; HetPipe once, on its first policy's configuration; HetPipe with the
--outer rule once more) trains pilots on --pilot_seed (outside --seeds) for --lr_epochs epochs: first the
rule's rate times each factor of --lr_grid (by default 7 factors log-spaced over two decades, 0.1 to 10) at
the default outer rate, then as many pilots again for every system as --outer_lr_grid has factors other than 1:
a system with an outer step (local SGD's outer Nesterov, --outer_lr; the --outer rule's lr) tries its outer
rate times each of them at the best inner rate, one without tries as many inner rates between the best and
its neighbours. Every system gets the same number of pilots of the same length; the pair whose smoothed test
accuracy (a loss: test loss) ends best is kept, and the runs use it (local SGD's outer learning rate; the
--outer row's ps_optimizer). A chosen inner rate at an end of the grid is reported as such.

Time to target: the test accuracy is smoothed by a trailing mean over --smooth evaluations (every
--eval_examples examples); a run reaches --target_accuracy at the first evaluation from which the smoothed
curve stays at or above it to the end. --target_accuracy=0 (the default) sets the target to 0.95 of the
best configuration's final smoothed accuracy (its mean over seeds). --full runs the study the goals are
measured on: 10 epochs, seeds 0, 1, 2 (learning-rate pilots of 1 epoch); the default is a shorter version
(2 epochs, seeds 0 and 1, pilots of 0.5 epochs) to stay quick.

Writes convergence.json (``target_accuracy``; every run with ``system``, ``name``, ``seed`` and
``time_to_target_s``, null when missed; the table; the learning rates and their pilots; the fitted
staleness model and its validation), a CSV of every curve and PNG plots, and prints one table: per
configuration images/s, efficiency against the ideal aggregate, its ratio to the best peer, the time to
target (mean, min, max over seeds) and the best peer's time over it. A language model's runs (the small GPT
on --dataset=tokens or text) report their test perplexity (exp of the mean test loss per token) against time
too: the CSV's ``test_perplexity`` column, each run's ``perplexity_curve`` ([time s, perplexity] at every
evaluation) and ``final_test_perplexity`` in the JSON, with the byte- (token-) unigram baseline
``unigram_test_perplexity`` (the training set's frequencies on the test set), a third plot panel and a
line per configuration::

  python -m experiments.convergence
  python -m experiments.convergence --full
  python -m experiments.convergence --model=gpt --dataset=text --optimizer=adam --lr_scaling=sqrt \
      --base_lr=0.001 --target_metric=loss --time_model=none --systems= --notuned --outer= --seeds=0 \
      --lr_grid=1 --policies=NP --cluster=hetero4 --epochs=3 --eval_examples=8000
  python -m experiments.convergence --time_model=resnet152 --out_dir=outputs/convergence_resnet152

The study is library code (:func:`hetpipe_jax.studies.convergence.run_convergence` of a
:class:`~hetpipe_jax.studies.convergence_config.ConvergenceConfig`); this script turns its flags into the config,
writes the files and prints the report.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from absl import flags

from experiments import common, peer_flags, run_flags
from hetpipe_jax import get_cluster
from hetpipe_jax.studies.convergence import ConvergenceConfig, ConvergenceResult, run_convergence
from hetpipe_jax.studies.convergence_config import PEERS, TUNED_OBJECTIVES
from hetpipe_jax.studies.convergence_lr import LR_GRID, OUTER_LR_GRID
from hetpipe_jax.studies.convergence_runs import ConvergenceRun
from hetpipe_jax.studies.convergence_summary import TableRow, is_peer
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.studies.convergence_tuned import TunedChoice
from hetpipe_jax.systems import BASE_LR_PER_32, LR_SCALINGS

FLAGS = flags.FLAGS
# The run settings the study takes (experiments.run_flags), at its defaults: the MLP (its gradient is cheap enough
# for every configuration over seeds), the paper's testbed, plain SGD.
run_flags.define(["model", "dataset", "cluster", "batch_size", "optimizer", "recompute", "lr_schedule", "ps_optimizer"],
                 overrides={"model": "mlp", "cluster": "paper_testbed", "optimizer": "sgd"})
flags.adopt_module_key_flags(run_flags)  # --help lists them
flags.DEFINE_list("policies", ["NP", "ED", "HD"], "HetPipe allocation policies (NP, ED, HD or groupings).")
flags.DEFINE_list("ds", ["0"], "Clock distance bounds D of the HetPipe policy runs.")
flags.DEFINE_string("nm", "max_fit", "HetPipe Nm: max_fit, best, speed (waves sized to each VW's speed) or a "
                    "number.")
flags.DEFINE_bool("tuned", True, "Add the tuned configuration (experiments.tune's search on the time model).")
flags.DEFINE_enum("tuned_objective", "measured", list(TUNED_OBJECTIVES),
                  "What the tuned configuration optimises: predicted time to the target (the staleness model "
                  "fitted to the first seed's runs; images/s when they give no fit), images/s, or measured time "
                  "to the target (--pilots runs on --pilot_seed, of the tuner's configurations on its "
                  "images/s-staleness front).")
flags.DEFINE_integer("pilots", 4, "--tuned_objective=measured: how many configurations are trained to choose "
                     "the tuned one.")
flags.DEFINE_integer("pilot_seed", 100, "Seed of the pilot runs (learning rates, --tuned_objective=measured); keep "
                     "it out of --seeds, so that no choice is fitted to the runs that judge it.")
flags.DEFINE_string("outer", ConvergenceConfig.outer, "Outer rules at the PS the extra tuned row chooses from, "
                    "separated by ';' (--ps_optimizer specs; nesterov's lr on DiLoCo's scale: the server takes lr / N "
                    "per push of N virtual workers): each rule's rates are searched as every system's, the rule whose "
                    "pilots end best is the row's, and its configuration is measured under it; empty: no such row.")
flags.DEFINE_list("systems", list(PEERS), "Peer systems "
                  "(hetpipe_jax.systems, and those --systems_module registers); their knobs: experiments.peer_flags "
                  "(--microbatches=0: the cluster's GPUs, the global batch of the data-parallel peers).")
peer_flags.override_defaults(h_by_speed=True)  # the study's one default of its own (experiments.peer_flags)
flags.DEFINE_float("base_lr", BASE_LR_PER_32, "The learning-rate rule's base: the rate of an update of 32 examples.")
flags.DEFINE_enum("lr_scaling", "linear", list(LR_SCALINGS), "How the rule scales --base_lr with the examples "
                  "of one update: linearly (SGD, Goyal et al. 2017) or with their square root (Adam, Malladi et "
                  "al. 2022).")
flags.DEFINE_list("lr_grid", [repr(x) for x in LR_GRID], "Inner learning-rate factors tried per system on the "
                  "rule's rate; the default: 7 factors log-spaced over two decades, 0.1 to 10 (10^(k/3), k = -3..3). "
                  "One factor alone: no pilots, every rate the rule's times it and every outer step at its default.")
flags.DEFINE_list("outer_lr_grid", [repr(x) for x in OUTER_LR_GRID], "Outer learning-rate factors tried at the best "
                  "inner rate on each system's default outer rate (local SGD's --outer_lr, the --outer rule's lr), by "
                  "every system with an outer step; each system without one tries as many inner rates between the "
                  "best and its neighbours (the same number of pilots for all). 1 alone: no second stage.")
flags.DEFINE_float("lr_epochs", 0.5, "Epochs of each learning-rate pilot run.")
flags.DEFINE_list("seeds", ["0", "1"], "Initialisation and shuffling seeds: every run once per seed.")
flags.DEFINE_float("epochs", 2.0, "Training examples seen by every run, in epochs.")
flags.DEFINE_integer("min_updates", 0, "The horizon's floor: every run (and pilot, by the same factor) is made "
                     "long enough that the system with the most examples per optimizer update takes this many "
                     "(0: --epochs as given).")
flags.DEFINE_bool("full", False, "The study the goals are measured on: --epochs=10, --lr_epochs=1, seeds 0, 1, 2, "
                  "--lr_schedule=cosine (warm-up 0.05, decay to 0.1) and --min_updates=200 (where those flags are "
                  "not given).")
flags.DEFINE_float("target_accuracy", 0.0, "Test accuracy (a test loss with --target_metric=loss) whose emulated "
                   "time is the headline; 0: 0.95 of the best configuration's final smoothed accuracy (mean over "
                   "seeds; a loss: the best final loss / 0.95).")
flags.DEFINE_enum("target_metric", "accuracy", ["accuracy", "loss"], "What the target is on: the test accuracy, or "
                  "the test loss (a language model: the small GPT on --dataset=tokens or text).")
flags.DEFINE_integer("smooth", 3, "Evaluations in the trailing mean of the smoothed accuracy curve.")
flags.DEFINE_integer("eval_examples", 6000, "Evaluate the test accuracy about every this many training examples.")
flags.DEFINE_integer("eval_test_examples", 0, "Test examples each evaluation takes, evenly spread over the test "
                     "split (0: all of it): a cheaper evaluation for the many runs of a study.")
flags.DEFINE_string("time_model", "vgg19", "vgg19, resnet152 or another full-size model: time axis from this "
                    "model's cost on the cluster; none: the trained model's own cost.")
flags.DEFINE_bool("ssp", False, "Add the SSP parameter-server baseline (one worker per GPU, Nm = 1).")
flags.DEFINE_integer("ssp_d", 4, "Staleness bound of the SSP baseline.")
flags.DEFINE_string("whimpy", "", "GPU type the peers may not use (the paper's 12 -> 16 GPU experiment: "
                    "'RTX 2060'); empty: they use every GPU they can.")
flags.DEFINE_string("out_dir", "outputs/convergence", "Where the JSON, CSV and plots go.")
flags.DEFINE_list("noise_levels", [], "Noise specs (hetpipe_jax.sim.noise: none, default, default*2, ...) under which "
                  "every run is timed again, one table each: a run of seed s under the level's noise with seed s, "
                  "every system adapting (--adapt); the numerics are the runs' own.")

FULL = {"epochs": 10.0, "lr_epochs": 1.0, "seeds": ["0", "1", "2"], "lr_schedule": "cosine",
        "min_updates": 200}  # --full, where the flag is not given
CSV_HEADER = ["name", "system", "seed", "d", "time_s", "minibatches", "epochs", "test_accuracy", "train_loss",
              "test_loss", "test_perplexity"]


def flags_to_config() -> ConvergenceConfig:
  """The study's configuration from the flags (--full applied; a bad value refused in one line)."""
  def full_or_given(name: str) -> Any:  # --full's value where it is on and the flag is not given
    return FULL[name] if FLAGS.full and not FLAGS[name].present else FLAGS[name].value

  seeds = tuple(common.parse_ints("seeds", full_or_given("seeds")))
  ds = tuple(common.parse_ints("ds", FLAGS.ds))
  grid = common.parse_floats("lr_grid", FLAGS.lr_grid, "one or more factors > 0, e.g. 0.1,0.3,1,3,10")
  outer_grid = common.parse_floats("outer_lr_grid", FLAGS.outer_lr_grid, "one or more factors > 0, e.g. 0.5,1,1.5")
  return ConvergenceConfig(
      get_cluster(FLAGS.cluster), model=FLAGS.model, dataset=FLAGS.dataset, time_model=FLAGS.time_model,
      policies=tuple(FLAGS.policies), ds=ds, nm=common.parse_nm(FLAGS.nm), tuned=FLAGS.tuned,
      tuned_objective=FLAGS.tuned_objective, pilots=FLAGS.pilots, pilot_seed=FLAGS.pilot_seed, outer=FLAGS.outer,
      ps_optimizer=FLAGS.ps_optimizer,
      systems=tuple(FLAGS.systems), knobs=peer_flags.knobs_from_flags(FLAGS), optimizer=FLAGS.optimizer,
      base_lr=FLAGS.base_lr, lr_scaling=FLAGS.lr_scaling, lr_grid=grid, outer_lr_grid=outer_grid,
      lr_epochs=full_or_given("lr_epochs"), lr_schedule=full_or_given("lr_schedule"),
      min_updates=full_or_given("min_updates"),
      seeds=seeds, epochs=full_or_given("epochs"), batch_size=FLAGS.batch_size,
      target_accuracy=FLAGS.target_accuracy, target_metric=FLAGS.target_metric, smooth=FLAGS.smooth,
      eval_examples=FLAGS.eval_examples, eval_test_examples=FLAGS.eval_test_examples,
      ssp=FLAGS.ssp, ssp_d=FLAGS.ssp_d, whimpy=FLAGS.whimpy, recompute=FLAGS.recompute,
      noise_levels=tuple(FLAGS.noise_levels))


def main(argv):
  del argv
  config = flags_to_config()
  common.ensure_devices(config.cluster.num_gpus)
  result = run_convergence(config, lambda line: common.progress("%s", line))
  paths = write_outputs(result, FLAGS.out_dir)
  report(result)
  common.print_outputs(paths.items(), width=5)


def write_outputs(result: ConvergenceResult, out_dir: str) -> dict[str, str]:
  """convergence.json, the CSV of every run's curve and the plot: kind -> path."""
  paths = {name: common.output_path(out_dir, f"convergence.{ext}")
           for name, ext in (("json", "json"), ("csv", "csv"), ("plot", "png"))}
  epoch = result.epoch
  common.write_json(paths["json"], result.to_json())
  common.write_csv(paths["csv"], CSV_HEADER,
                   ([run.name, run.system, run.seed, run.d, p.time, p.minibatches, p.minibatches / epoch,
                     p.test_accuracy, p.train_loss, p.test_loss, math.exp(p.test_loss)]
                    for run in result.runs for p in run.curve))
  c = result.config
  plot(result.runs, epoch, Target(c.target_metric, c.smooth), result.target, paths["plot"],
       f"{result.model} on {result.dataset}; time: {result.time_axis}; seeds {list(c.seeds)}",
       None if result.unigram is None else result.unigram.unigram_test_perplexity)
  return paths


def report(result: ConvergenceResult) -> None:
  """Prints the learning rates, the one table, the staleness, the fit, the tuned configuration's prediction
  and the time axis."""
  print_learning_rates(result)
  for system, reason in result.not_run.items():
    print(f"{system}: not run ({reason})")
  print_table(result)
  print_perplexity(result)
  print_staleness(result)
  print_fit(result)
  print_tuned(result)
  print(f"time axis: {result.time_axis} (emulated seconds, not wall time); {result.unit}/s: the sim executor's, "
        "or the peer's simulated round")


def print_learning_rates(result: ConvergenceResult) -> None:
  """Each system's chosen rates, and its pilots' final smoothed values."""
  print(f"learning rates ({result.lr_rule}):")
  for system, choice in result.lr_choices.items():
    outer = "" if choice.outer_lr is None else f", outer {choice.outer_lr:.4g} (x{choice.outer_factor:g} its default)"
    edge = "; at an end of --lr_grid: widen it" if choice.at_edge else ""
    print(f"  {system}: {choice.lr:.4g} (x{choice.factor:.4g} the rule's {choice.rule_lr:.4g}){outer}, "
          f"{choice.pilots} pilots{edge}")
    pilots = [p for p in result.lr_pilots if p.system == system]
    if pilots:
      print("    pilots (inner[/outer] -> final): " + ", ".join(
          f"{p.lr:.3g}{'' if p.outer_lr is None else f'/{p.outer_lr:.3g}'} -> "
          f"{'diverged' if p.final_smoothed is None else f'{p.final_smoothed:.4f}'}" for p in pilots))


def print_table(result: ConvergenceResult) -> None:
  """The table of the study (:func:`hetpipe_jax.studies.convergence_summary.table`), and one per noise level."""
  c, target = result.config, result.target
  what = "test loss" if c.target_metric == "loss" else "test accuracy"
  print(f"target: {target:.4f} {what} ({result.target_rule}), smoothed over {c.smooth} evaluations; "
        f"{result.epochs:.4g} epochs; seeds {list(c.seeds)}; HetPipe's staleness control {c.knobs.staleness}")
  noise = result.noise_scale
  print("gradient noise scale at the target: " + ("not measured (no synchronous run reached it)" if noise is None else
        f"B_simple {noise.b_simple:.4g} examples ({noise.at}; {noise.examples} per-example gradients)"))
  print_rows(result, result.table)
  for level, rows in result.noise_tables.items():
    print(f"under noise {level} (a run of seed s timed under it with noise seed s; every system adapting: "
          f"--adapt={c.knobs.adapt}):")
    print_rows(result, rows)


def print_rows(result: ConvergenceResult, rows: list[TableRow]) -> None:
  """One table's rows, and what its columns mean."""
  unit, per = result.unit, result.per_example
  print(f"{'configuration':58} {'GPUs':>4} {unit + '/s':>9} {'eff.':>5} {'vs peer':>7} "
        f"{'time to target: mean (min..max) s':>34} {'vs peer':>7} {'examples':>9} {'vs peer':>7} {'ex/upd':>6} "
        f"{'updates':>13} {'final':>6}")
  for r in rows:
    ratio = f"{r.images_per_sec_vs_best_peer:.2f}x" if r.images_per_sec_vs_best_peer else "-"
    t = r.mean_time_to_target_s
    when = (f"{t:.4g} ({r.min_time_to_target_s:.4g}..{r.max_time_to_target_s:.4g})" if t is not None
            else f"missed by {r.missed} of {r.seeds}")
    speed = f"{r.speedup_vs_best_peer:.2f}x" if r.speedup_vs_best_peer else "-"
    examples = f"{r.mean_examples_to_target:9.0f}" if r.mean_examples_to_target else f"{'-':>9}"
    more = f"{r.examples_vs_best_peer:.2f}x" if r.examples_vs_best_peer else "-"
    to = f"{r.mean_updates_to_target:.0f}" if r.mean_updates_to_target else "-"
    print(f"{r.name[:58]:58} {r.gpus:>4} {r.images_per_sec * per:9.1f} {r.efficiency:5.2f} {ratio:>7} "
          f"{when:>34} {speed:>7} {examples} {more:>7} {r.examples_per_update:>6} {to + '/' + str(r.updates):>13} "
          f"{r.mean_final_smoothed_accuracy:6.4f}")
  print(f"vs peer: {unit}/s over the best peer's; the best peer's mean time to target over this one's (> 1: faster); "
        "examples to target (mean over seeds) over the fewest of a peer (> 1: more); ex/upd: examples per optimizer "
        "update; updates: to target / in the run, of one weight copy")


def print_perplexity(result: ConvergenceResult) -> None:
  """A language model's final test perplexity per configuration, beside the unigram baseline's."""
  if result.unigram is None:
    return
  print(f"test perplexity (exp of the test loss per token; the training set's unigram frequencies: "
        f"{result.unigram.unigram_test_perplexity:.4g}, loss {result.unigram.unigram_test_loss:.4f}):")
  for name, s in result.summary.items():
    runs = [r for r in result.runs if r.name == name]
    loss = sum(r.outcome.final_test_loss for r in runs if r.outcome) / len(runs)
    print(f"  {name}: final {s.mean_final_test_perplexity:.4g} (mean over {len(runs)} seeds; loss {loss:.4f}) at "
          f"{runs[0].curve[-1].time:.4g} s")


def print_staleness(result: ConvergenceResult) -> None:
  """Every HetPipe configuration's mean and largest staleness, and its time scale to the sim executor."""
  for name in result.summary:
    stats = [r.wsp for r in result.runs if r.name == name and r.wsp is not None]
    if stats:
      print(f"{name}: mean staleness {sum(s.mean_staleness for s in stats) / len(stats):.2f}, global max "
            f"{max(s.staleness['max_global_staleness'] or 0 for s in stats)} (bound "
            f"{max(stats[0].staleness['global_bound'])}); time axis x{stats[0].time_scale:.3f} to the sim executor")


def print_fit(result: ConvergenceResult) -> None:
  """The fitted staleness-aware estimate and its leave-one-out error (or why there is none)."""
  check = result.staleness
  if check.model is None:
    print(f"staleness-aware estimate: not fitted ({check.note})")
    return
  error = ("no run to leave out" if check.mean_abs_error is None else
           f"mean {check.mean_abs_error:.1%}, worst {check.max_abs_error:.1%} over {len(check.runs)} runs")
  print(f"staleness-aware estimate: images to {result.target:.4g} = {check.model.images0:.4g} x (1 + "
        f"{check.model.beta:.4g} x mean staleness); leave-one-out error on time to target: {error}")


def print_tuned(result: ConvergenceResult) -> None:
  """The pilot runs, and the tuned configuration's predicted time to target against the measured one."""
  tuned: TunedChoice | None = result.tuned
  if tuned is None:
    return
  for p in tuned.pilots:
    when = "not reached" if p.time_to_target_s is None else f"{p.time_to_target_s:.4g} s"
    rate = p.images_per_sec * result.per_example
    print(f"pilot (seed {p.seed}): {p.label}: {rate:.1f} {result.unit}/s, mean staleness {p.mean_staleness:.2f}, "
          f"time to the provisional target {when}")
  if tuned.predicted_time_to_target_s is None:
    return
  measured = result.summary[tuned.specs[0].name].mean_time_to_target_s
  how = "the pilot runs" if tuned.objective == "measured" else "predicted time to the provisional target"
  print(f"tuned by {how} ({tuned.label}): the estimate predicted {tuned.predicted_time_to_target_s:.4g} s to "
        f"{tuned.provisional_target:.4g} before it ran; measured to {result.target:.4g}: " +
        (f"{measured:.4g} s (mean over seeds)" if measured is not None else "not reached by every seed"))


def plot(runs: list[ConvergenceRun], epoch: float, rule: Target, target: float, path: str, title: str,
         unigram_perplexity: float | None = None) -> None:
  """Test accuracy against emulated time and against epochs: per configuration the mean over seeds, and
  the band between the lowest and highest seed (every seed is evaluated at the same points); peers dashed.
  A language model (``unigram_perplexity`` given) adds its test perplexity against emulated time, and the
  unigram baseline's."""
  plt = common.pyplot()
  language = unigram_perplexity is not None
  fig, axes = plt.subplots(1, 3 if language else 2, figsize=(19 if language else 13, 4.6))
  ax_t, ax_e = axes[0], axes[1]
  for name in dict.fromkeys(run.name for run in runs):
    same = [r for r in runs if r.name == name]
    n = min(len(r.curve) for r in same)
    acc = np.array([rule.values(r.curve[:n]) for r in same])
    ppl = np.exp(np.array([[p.test_loss for p in r.curve[:n]] for r in same]))
    style = "--" if is_peer(same[0].system) else "-"
    times = [p.time for p in same[0].curve[:n]]
    panels = [(ax_t, times, acc), (ax_e, [p.minibatches / epoch for p in same[0].curve[:n]], acc)]
    panels += [(axes[2], times, ppl)] if language else []
    for ax, x, y in panels:
      line, = ax.plot(x, y.mean(axis=0), style, label=f"{name[:50]} ({len(same)} seeds)")
      if len(same) > 1:
        ax.fill_between(x, y.min(axis=0), y.max(axis=0), color=line.get_color(), alpha=0.15, lw=0)
  if language:
    axes[2].axhline(unigram_perplexity, color="grey", lw=0.8, ls=":", label="unigram baseline")
    axes[2].set(xlabel="emulated time (s)", ylabel="test perplexity (mean; band: seeds' range)", xscale="log")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=6, loc="upper right")
  for ax in (ax_t, ax_e):
    ax.axhline(target, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
  ax_e.legend(fontsize=6, loc="lower right")
  ax_t.set(xlabel="emulated time (s)", ylabel=f"{rule.what} (mean; band: seeds' range)", xscale="log")
  ax_e.set(xlabel="epochs", ylabel=f"{rule.what} (mean; band: seeds' range)")
  fig.suptitle(title, fontsize=9)
  common.save_figure(fig, path)


cli = common.console(main)

if __name__ == "__main__":
  cli()
