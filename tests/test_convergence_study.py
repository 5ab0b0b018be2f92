"""The convergence study as library code (:mod:`hetpipe_jax.studies.convergence`): its config refuses bad settings in
one line, HetPipe's configurations train through :mod:`hetpipe_jax.systems.hetpipe` (a run whose gate never closed
reused at a larger D; the clock scaled to the sim executor), and a small study runs through
:func:`~hetpipe_jax.studies.convergence.run_convergence`."""

import json
import types

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import convergence as script
from experiments.common import batch_profiles
from hetpipe_jax import ConfigError, RunConfig, get_cluster, get_model, synthetic
from hetpipe_jax.studies.convergence import ConvergenceConfig, run_convergence
from hetpipe_jax.studies.convergence_study import Study, examples_unit
from hetpipe_jax.systems import TrainSetting
from hetpipe_jax.systems.hetpipe import HetPipe, HetPipeSetting, Trainer, WaveRun, training_of

from helpers import assert_trace_ok

MINI = get_cluster("paper_mini")


@pytest.mark.parametrize("change, message", [
    ({"seeds": ()}, "--seeds is empty; give one or more seeds, e.g. --seeds=0,1,2"),
    ({"seeds": (0, -1)}, r"--seeds=-1; a seed must be in \[0, 2\*\*63 - 1\]"),
    ({"ds": (0, -2)}, "--ds=0,-2; give one or more clock distance bounds D >= 0"),
    ({"epochs": 0.0}, "--epochs=0.0; give > 0"),
    ({"smooth": 0}, "--smooth=0; give >= 1"),
    ({"eval_test_examples": -1}, r"--eval_test_examples=-1; give >= 0 \(0: the whole split\)"),
    ({"target_accuracy": 1.5}, r"--target_accuracy=1.5; give in \[0, 1\] for an accuracy"),
    ({"lr_grid": (0.5, 0.0)}, "--lr_grid=0.5,0; give one or more distinct factors > 0, e.g. 0.1,0.3,1,3,10"),
    ({"pilot_seed": 1}, "--pilot_seed=1 is one of --seeds; use a seed outside them"),
    ({"pilots": 0}, "--pilots=0; --tuned_objective=measured needs at least 1 pilot run"),
    ({"time_model": "vgg99"}, "--time_model=vgg99; use one of vgg19, "),
    ({"optimizer": "lion"}, "--optimizer=lion; choose one of sgd, momentum, adam, adamw, muon"),
    ({"policies": ()}, "--policies is empty"),
    ({"recompute": "most"}, "--recompute=most; choose one of none, selective, full, auto"),
])
def test_the_config_refuses_a_bad_setting_in_one_line(change, message):
  with pytest.raises(ConfigError, match=message) as e:
    ConvergenceConfig(MINI, **change)
  assert "\n" not in str(e.value)


def test_a_loss_target_may_exceed_one_and_notuned_takes_no_pilots():
  config = ConvergenceConfig(MINI, target_metric="loss", target_accuracy=2.5, tuned=False, pilots=0)
  assert config.target_accuracy == 2.5 and config.time_model_name == "vgg19"
  assert ConvergenceConfig(MINI, time_model="none").time_model_name is None


def test_the_flags_defaults_are_the_configs_and_full_keeps_a_given_flag():
  fv, parsed = flags.FLAGS, flags.FLAGS.is_parsed()
  try:
    with flagsaver.flagsaver():
      fv(["convergence", "--cluster=paper_mini"])
      assert script.flags_to_config() == ConvergenceConfig(MINI)  # one default each, the config's
      fv.unparse_flags()
      fv(["convergence", "--cluster=paper_mini", "--full", "--epochs=3"])
      config = script.flags_to_config()
      assert (config.epochs, config.lr_epochs, config.seeds) == (3.0, 1.0, (0, 1, 2))
  finally:
    if not parsed:
      fv.unparse_flags()


def test_a_setting_gives_the_virtual_run_its_layout_and_the_sim_run_its_transfers():
  tuned = HetPipeSetting([[0, 1], [2, 3]], [2, 3], 4, [[0, 2, 4], [0, 1, 4]], [2, 2], "local", "nesterov:lr=0.1",
                         True, False)
  assert tuned.run_fields() == {"policy": [[0, 1], [2, 3]], "cuts": [[0, 2, 4], [0, 1, 4]], "nm": [2, 3],
                                "window": [2, 2], "d": 4, "placement": "local", "ps_optimizer": "nesterov:lr=0.1"}
  layout = {k: v for k, v in tuned.run_fields().items() if k != "ps_optimizer"}  # an outer optimizer takes no time
  assert tuned.sim_fields() == {**layout, "overlap_transfers": True, "staged_ps": False}
  assert HetPipeSetting("ED", "max_fit", 2).run_fields() == {"policy": "ED", "nm": "max_fit", "d": 2}


def test_a_run_whose_gate_never_closed_is_reused_at_a_larger_d():
  data = synthetic(num_train=256, num_test=64)
  base = RunConfig.of(cluster=MINI, batch_size=32, executor="virtual")
  said = []
  trainer = Trainer(get_model("mlp"), data, base, said.append)
  layout = HetPipeSetting("ED", "max_fit", 0)
  run = WaveRun(0, 3, 0.05, 1)
  first = trainer.train(layout, run, "D=0")
  assert_trace_ok(first.events)
  assert not any(e["ev"] == "wait" for e in first.events)  # ED's pipelines keep pace: no wait at D=0
  again = trainer.train(layout._replace(d=3), run, "D=3")
  assert said == ["D=3: the same run as at D=0 (its gate never closed)"]
  assert again.metrics == first.metrics and again.events[0]["d"] == 3 and again.events[1:] == first.events[1:]
  other = trainer.train(layout._replace(d=3), run._replace(lr=0.1), "another rate")
  assert len(said) == 1 and other.events[0]["d"] == 3  # another learning rate: a run of its own
  t = training_of(again, 2.0)
  assert t.nm == [4] and t.gpus == 4  # ED on paper_mini: one pipeline of its 4 GPUs, Nm 4
  assert t.time_scale == 2.0 and t.mean_staleness >= 0
  assert [p.time for p in t.curve] == pytest.approx([2.0 * r["time"] for r in again.metrics if "test_accuracy" in r])


def test_hetpipe_trains_on_the_clock_of_its_simulated_rate():
  profiles = batch_profiles("mlp", 32)[0]
  run = HetPipe().simulate(MINI, profiles, 32)
  curve = HetPipe().train(get_model("mlp"), synthetic(num_train=512, num_test=64), run,
                          TrainSetting(0, 0.05, "sgd", 1.0, 128, 32))
  assert len(curve) >= 2 and all(0 <= p.test_accuracy <= 1 for p in curve)
  # the last evaluation is at the end of the run: examples over time is the simulated examples/s
  assert curve[-1].minibatches * 32 / curve[-1].time == pytest.approx(run.images_per_sec, rel=1e-9)


@pytest.mark.slow  # about 15 s: a peer, HetPipe at two D (the second reused), SSP, each compiled
def test_a_small_study_runs_through_run_convergence():
  lines = []
  config = ConvergenceConfig(MINI, model="mlp", dataset="digits", time_model="none", policies=("ED",), ds=(0, 2),
                             tuned=False, outer="", systems=("horovod",), seeds=(0,), lr_grid=(1.0,), epochs=0.5,
                             eval_examples=60, ssp=True)
  result = run_convergence(config, lines.append)
  assert [(r.name, r.system, r.d) for r in result.runs] == [
      ("horovod (4 GPUs)", "horovod", 0), ("HetPipe ED D=0", "hetpipe", 0), ("HetPipe ED D=2", "hetpipe", 2),
      ("SSP PS (4 GPUs) D=4", "ssp", 4)]
  assert "seed 0, HetPipe ED D=2: the same run as at D=0 (its gate never closed)" in lines
  d0, d2 = result.runs[1], result.runs[2]
  assert d0.curve == d2.curve and d2.wsp is not None and d2.wsp.staleness["global_bound"] != []
  assert result.learning_rates == {"horovod": 0.08, "hetpipe": 0.02} and result.lr_pilots == []  # one factor
  best = max(sum(p.test_accuracy for p in r.curve[-3:]) / len(r.curve[-3:]) for r in result.runs)
  assert result.target == pytest.approx(0.95 * best)  # the automatic target
  assert [t.name for t in result.table] == list(result.summary) and result.table[0].images_per_sec_vs_best_peer == 1
  doc = json.loads(json.dumps(result.to_json()))
  assert doc["tuned"] == {} and doc["runs"][0]["global_batch"] == 128 and doc["runs"][3]["system"] == "ssp"
  assert "outcome" not in doc["runs"][0] and "perplexity_curve" not in doc["runs"][0]  # an image model
  assert {"time_to_target_s", "final_smoothed_accuracy", "mean_staleness"} <= set(doc["runs"][1])
  assert ("staleness_model" in doc) != ("staleness_note" in doc)
  # the noise scale at the weights where Horovod reached the target, beside each row's examples per update
  noise = result.noise_scale
  assert noise is not None and noise.b_simple > 0 and noise.examples == 1024 and noise.at.startswith("horovod")
  assert [r.examples_per_update for r in result.table] == [128, 32, 32, 32]  # horovod's global batch; a minibatch


@pytest.mark.parametrize("outer, spec", [
    ("nesterov:lr=0.8,momentum=0.9", "nesterov:lr=0.2,momentum=0.9"),  # DiLoCo's rate per round, over N per push
    ("add", "add"),
    ("avg:lr=0.8", "avg:lr=0.8,share=1.0"),  # the rules of a round weigh the pushes themselves
    ("delayed_nesterov:lr=0.8,momentum=0.9", "delayed_nesterov:lr=0.8,momentum=0.9,share=1.0"),
    ("heloco:lr=0.8", "heloco:lr=0.8,momentum=0.9,share=1.0,keep=0.5,shrink=1.0,cap=1.0,turn=0.5,kappa=1.0"),
])
def test_the_outer_rows_rule_takes_its_rate_per_push_once(outer, spec):
  study = types.SimpleNamespace(config=ConvergenceConfig(MINI, outer=outer))
  assert Study.outer_spec(study, 4, outer) == spec


def test_a_language_model_counts_tokens_on_any_time_axis():
  """Throughput counts tokens for a GPT: the time model's context, or the trained model's sequence on its own
  clock (the small GPT on text with --time_model=none); images otherwise."""
  text_like = types.SimpleNamespace(x_train=np.zeros((4, 64), np.int32), y_train=np.zeros((4, 64), np.int32))
  images = synthetic(num_train=8, num_test=8)
  assert examples_unit(None, text_like) == 64
  assert examples_unit(None, images) == 1
  assert examples_unit("gpt2-xl", images) == 1024
  assert examples_unit("resnet152", text_like) == 1


def test_the_policy_rows_take_the_studys_ps_rule_on_diloco_scale_and_say_so():
  config = ConvergenceConfig(MINI, ps_optimizer="nesterov:lr=0.8,momentum=0.9", policies=("ED",))
  study = types.SimpleNamespace(config=config, policies=["ED"], plan_nms=lambda setting: [2, 2, 2, 2])
  study.outer_spec = lambda n, rule, lr=None: Study.outer_spec(study, n, rule, lr)
  [spec] = Study.policy_specs(study)  # type: ignore[arg-type]
  assert spec.name == "HetPipe ED D=0 + nesterov" and spec.setting.ps_optimizer == "nesterov:lr=0.2,momentum=0.9"
  add = types.SimpleNamespace(config=ConvergenceConfig(MINI, policies=("ED",)), policies=["ED"])
  assert [(s.name, s.setting.ps_optimizer) for s in Study.policy_specs(add)] == [("HetPipe ED D=0", None)]  # type: ignore[arg-type]
  with pytest.raises(ConfigError, match="unknown optimizer 'adagrad'"):
    ConvergenceConfig(MINI, ps_optimizer="adagrad")
