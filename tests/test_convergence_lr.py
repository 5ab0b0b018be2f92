"""The convergence study's learning-rate search (:mod:`hetpipe_jax.studies.convergence_lr`): one log-spaced inner grid
over two decades, the outer rate searched for every system that declares one, the same number of pilots for every
system, the chosen outer rate in the runs, bad grids refused in one line."""

import collections
import math
import types

import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import convergence as script
from hetpipe_jax import ConfigError, get_cluster
from hetpipe_jax.baselines.knobs import PeerKnobs
from hetpipe_jax.studies.convergence import ConvergenceConfig
from hetpipe_jax.studies.convergence_lr import (
  GRID,
  LR_GRID,
  OUTER,
  OUTER_LR_GRID,
  REFINE,
  LrPilot,
  refinements,
  search_rates,
  spec_outer_lr,
)
from hetpipe_jax.studies.convergence_runs import Runner
from hetpipe_jax.studies.convergence_study import HETPIPE, Spec, Study, outer_system
from hetpipe_jax.studies.convergence_target import Target
from hetpipe_jax.studies.convergence_tuned import TUNED, TUNED_EXAMPLES, TUNED_OUTER, tuned_specs
from hetpipe_jax.systems import CurvePoint, LocalSGD, SystemRun, SystemSpec
from hetpipe_jax.systems.base import DEFAULT_KNOBS
from hetpipe_jax.systems.hetpipe import HetPipeSetting

MINI = get_cluster("paper_mini")
RULE = 0.02  # the rule's rate of a 32-example update (the study's default base)


def test_the_default_inner_grid_spans_two_decades_log_spaced_and_the_outer_grid_holds_the_default():
  assert len(LR_GRID) == 7 and LR_GRID[0] == pytest.approx(0.1) and LR_GRID[-1] == pytest.approx(10.0)
  ratios = [b / a for a, b in zip(LR_GRID, LR_GRID[1:])]
  assert ratios == pytest.approx([10 ** (1 / 3)] * 6)  # one step, 3 per decade
  assert 1.0 in LR_GRID and 1.0 in OUTER_LR_GRID and min(OUTER_LR_GRID) < 1 < max(OUTER_LR_GRID)
  config = ConvergenceConfig(MINI)
  assert config.lr_grid == LR_GRID and config.outer_lr_grid == OUTER_LR_GRID


@pytest.mark.parametrize("has_outer", [True, False])
@pytest.mark.parametrize("grid, outer_grid, pilots", [
    (LR_GRID, OUTER_LR_GRID, 7 + 2), ((0.5, 1.0, 2.0), (1.0,), 3), ((0.5, 2.0), (0.5, 2.0), 2 + 2), ((1.0,), (0.5,), 0),
])
def test_every_system_gets_the_same_number_of_pilots(has_outer, grid, outer_grid, pilots):
  calls = []
  score = lambda f, o, stage: calls.append((f, o, stage)) or -abs(math.log(f / 2.0))  # best inner: nearest 2
  best = min(grid, key=lambda f: abs(math.log(f / 2.0)))
  factor, outer = search_rates(score, grid, outer_grid, has_outer)
  assert len(calls) == pilots
  assert [c for c in calls if c[2] == GRID] == ([(f, 1.0, GRID) for f in sorted(grid)] if len(grid) > 1 else [])
  second = [c for c in calls if c[2] != GRID]
  assert all(c[2] == (OUTER if has_outer else REFINE) for c in second)
  if has_outer and len(grid) > 1:  # the outer grid at the best inner factor
    assert second == [(best, o, OUTER) for o in sorted(outer_grid) if o != 1.0]
  if len(grid) == 1:
    assert (factor, outer) == (1.0, 1.0)


def test_the_outer_stage_keeps_the_best_pair_and_a_tie_goes_to_the_smaller_rate():
  score = lambda f, o, stage: -abs(math.log10(f)) - abs(o - 1.5)  # best: inner x1, outer x1.5
  assert search_rates(score, LR_GRID, OUTER_LR_GRID, True) == (pytest.approx(1.0), 1.5)
  assert search_rates(lambda f, o, stage: -math.inf, (0.5, 1.0), (0.5, 1.0), True) == (0.5, 0.5)  # all diverged
  flat = lambda f, o, stage: 0.0
  assert search_rates(flat, (0.5, 1.0, 2.0), (1.0, 2.0), True) == (0.5, 1.0)


def test_refinements_lie_between_the_best_and_its_neighbours():
  step = 10 ** (1 / 3)
  assert refinements(LR_GRID, LR_GRID[3], 2) == pytest.approx([step ** -0.5, step ** 0.5])
  assert refinements(LR_GRID, LR_GRID[3], 4) == pytest.approx([step ** (-1 / 3), step ** (1 / 3), step ** (-2 / 3),
                                                               step ** (2 / 3)])
  assert refinements((1.0, 4.0), 4.0, 2) == pytest.approx([2.0, 8.0])  # at an end: the one step, mirrored past it
  # steps of 2 below and 4 above, in thirds: 2 x 2^(-1/3), 2 x 4^(1/3), 2 x 2^(-2/3)
  assert refinements((1.0, 2.0, 8.0), 2.0, 3) == pytest.approx([2 ** (2 / 3), 2 * 4 ** (1 / 3), 2 ** (1 / 3)])
  assert refinements(LR_GRID, LR_GRID[0], 0) == []


@pytest.mark.parametrize("change, message", [
    ({"lr_grid": ()}, "--lr_grid=; give one or more distinct factors > 0, e.g. 0.1,0.3,1,3,10"),
    ({"lr_grid": (0.5, 0.0)}, "--lr_grid=0.5,0; give one or more distinct factors > 0"),
    ({"lr_grid": (1.0, math.inf)}, "--lr_grid=1,inf; give one or more distinct factors > 0"),
    ({"lr_grid": (1.0, 2.0, 1.0)}, "--lr_grid=1,2,1; give one or more distinct factors > 0"),
    ({"outer_lr_grid": (-1.0, 1.0)}, "--outer_lr_grid=-1,1; give one or more distinct factors > 0, e.g. 0.5,1,1.5"),
    ({"outer_lr_grid": ()}, "--outer_lr_grid=; give one or more distinct factors > 0"),
])
def test_a_bad_grid_is_refused_in_one_line(change, message):
  with pytest.raises(ConfigError, match=message) as e:
    ConvergenceConfig(MINI, **change)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--outer_lr_grid=0.5,x"], "--outer_lr_grid=0.5,x; give one or more factors > 0, e.g. 0.5,1,1.5"),
    (["--lr_grid=1,1"], "--lr_grid=1,1; give one or more distinct factors > 0"),
])
def test_the_scripts_flags_refuse_a_bad_grid_in_one_line(argv, message):
  fv, parsed = flags.FLAGS, flags.FLAGS.is_parsed()
  try:
    with flagsaver.flagsaver():
      fv(["convergence", "--cluster=paper_mini", *argv])
      with pytest.raises(ConfigError, match=message) as e:
        script.flags_to_config()
      assert "\n" not in str(e.value)
  finally:
    if not parsed:
      fv.unparse_flags()


def test_a_spec_declares_its_outer_rate_and_a_system_its_knob():
  assert spec_outer_lr("nesterov:lr=0.7,momentum=0.9") == 0.7 and spec_outer_lr("avg") == 1.0
  assert spec_outer_lr("add") is None
  assert LocalSGD().outer_lr(PeerKnobs(outer_lr=0.5)) == 0.5
  assert LocalSGD().with_outer_lr(PeerKnobs(), 1.05).outer_lr == 1.05
  assert Plain().outer_lr(PeerKnobs()) is None and Plain().with_outer_lr(PeerKnobs(), 2.0) == PeerKnobs()


def flat_curve(value):
  return [CurvePoint(float(t), float(t), value, 1.0, 1.0 - value) for t in range(1, 4)]


def peaked(lr, best_lr, outer=None, best_outer=None):
  """A pilot's final accuracy: highest at (best_lr, best_outer), lower by 0.1 per decade and per unit of outer."""
  value = 0.9 - 0.1 * abs(math.log10(lr / best_lr))
  return value - (0.0 if outer is None else 0.1 * abs(outer - best_outer))


class Recording(LocalSGD):
  """Local SGD whose training records its knobs and returns a curve peaked at one pair of rates."""

  def __init__(self, best_lr, best_outer):
    self.best_lr, self.best_outer, self.knobs = best_lr, best_outer, []

  def train(self, model, dataset, run, setting, knobs=DEFAULT_KNOBS):
    self.knobs.append(knobs)
    outer = self.outer_lr(knobs)
    return flat_curve(peaked(setting.lr, self.best_lr, outer, self.best_outer))


class Plain(Recording):
  """The same without an outer step (it declares none)."""

  name = "plain"
  outer_lr_knob = None

  def __init__(self, best_lr=RULE, best_outer=None):
    super().__init__(best_lr, best_outer)


def small_runner(monkeypatch, local, plain):
  """A runner over a study of two peers and HetPipe (two virtual workers), its training replaced by curves peaked
  at known rates: HetPipe's best inner rate 0.02 x 10^(1/3); with the outer rule, outer 0.35 (x0.5)."""
  run = SystemRun("local_sgd", 1.0, 64, 64.0, 128.0, (32, 32), (4, 2), 4)
  setting = HetPipeSetting([[0, 1], [2, 3]], [2, 2], 0, [[0, 1, 2], [0, 1, 2]])
  hetpipe = Spec("HetPipe ED D=0", setting, "HetPipe ED D=0")
  config = ConvergenceConfig(MINI, seeds=(0,), outer="nesterov:lr=0.7,momentum=0.9")
  study = types.SimpleNamespace(config=config, model=None, dataset=types.SimpleNamespace(x_train=range(640)),
                                base=None, knobs=PeerKnobs(), epochs=config.epochs, lr_epochs=config.lr_epochs,
                                update_examples={},
                                peers=[SystemSpec(local, "local_sgd (4 GPUs)", run, None),
                                       SystemSpec(plain, "plain (4 GPUs)", run, None)],
                                target=Target("accuracy", 3), policy_specs=lambda: [hetpipe],
                                plan_nms=lambda s: list(s.nm))
  study.outer_spec = lambda n, rule, lr=None: Study.outer_spec(study, n, rule, lr)  # type: ignore[arg-type]
  runner = Runner(study, lambda line: None)  # type: ignore[arg-type]
  trained = []

  def train(spec, seed, lr, epochs=None):
    trained.append(spec)
    rule = spec.setting.ps_optimizer
    outer = None if rule is None else spec_outer_lr(rule) * len(spec.setting.nm)  # DiLoCo's scale: x N
    return types.SimpleNamespace(curve=flat_curve(peaked(lr, RULE * 10 ** (1 / 3), outer, 0.35)))

  monkeypatch.setattr(runner, "train", train)
  return runner, trained


NESTEROV = outer_system("nesterov:lr=0.7,momentum=0.9")  # HetPipe with the outer rule: its learning-rate system


def test_every_system_is_searched_alike_and_its_chosen_outer_rate_reaches_its_run(monkeypatch):
  local, plain = Recording(RULE * 10 ** (2 / 3), 0.7 * 1.5), Plain(RULE * 10 ** 0.5)
  runner, trained = small_runner(monkeypatch, local, plain)
  runner.choose_learning_rates()
  pilots = runner.lr_pilots
  assert collections.Counter(p.system for p in pilots) == {"local_sgd": 9, "plain": 9, HETPIPE: 9, NESTEROV: 9}
  assert {(p.seed, p.epochs) for p in pilots} == {(100, 0.5)} and all(len(p.curve) == 3 for p in pilots)
  for system in runner.choices:  # stage 1: the same inner grid for every system, at its default outer rate
    mine = [p for p in pilots if p.system == system]
    assert [p.factor for p in mine if p.stage == GRID] == list(LR_GRID)
    has_outer = system in ("local_sgd", NESTEROV)
    assert [p.stage for p in mine].count(OUTER if has_outer else REFINE) == 2
  choices = runner.choices
  assert choices["local_sgd"].factor == pytest.approx(10 ** (2 / 3))
  assert choices["local_sgd"].outer_lr == 1.05 and choices["local_sgd"].outer_factor == 1.5
  assert choices["plain"].factor == pytest.approx(10 ** 0.5) and choices["plain"].outer_lr is None  # refined
  assert choices[HETPIPE].factor == pytest.approx(10 ** (1 / 3)) and choices[HETPIPE].outer_lr is None
  assert choices[NESTEROV].outer_lr == pytest.approx(0.35) and choices[NESTEROV].outer_factor == 0.5
  assert all(c.pilots == 9 and not c.at_edge for c in choices.values())
  # HetPipe's outer pilots ran the rule at each outer rate, per push over its 2 virtual workers
  rules = [s.setting.ps_optimizer for s in trained if s.lr_system == NESTEROV]
  assert rules[-2:] == ["nesterov:lr=0.175,momentum=0.9", "nesterov:lr=0.525,momentum=0.9"]
  # the runs take the chosen rates: local SGD's outer knob, the plain peer's knobs untouched
  run = runner.peer_run(runner.study.peers[0], 0)
  outer = choices["local_sgd"].outer_lr
  assert local.knobs[-1].outer_lr == outer and run.to_json()["outer_lr"] == outer and run.lr == choices["local_sgd"].lr
  run = runner.peer_run(runner.study.peers[1], 0)
  assert plain.knobs[-1] == PeerKnobs() and "outer_lr" not in run.to_json()
  # the tuned configuration's outer row: the chosen rate, per push over its virtual workers
  plan = types.SimpleNamespace(gpus=[types.SimpleNamespace(index=i) for i in range(2)], cuts=(0, 1, 2), nm=2,
                               in_flight=2, tp=None)
  tuned = types.SimpleNamespace(grouping="0,1/2,3/4,5", nm_rule="max_fit", plans=(plan, plan, plan), d=0,
                                placement=None, label="tuned", sim=types.SimpleNamespace(overlap_transfers=None,
                                                                                         staged_ps=None))
  assert runner.best_outer_rule() == "nesterov:lr=0.7,momentum=0.9"  # the only rule
  outer_row = tuned_specs(runner, tuned, tuned, runner.best_outer_rule())[1]
  assert outer_row.row == TUNED_OUTER and outer_row.lr_system == NESTEROV
  assert outer_row.setting.ps_optimizer == f"nesterov:lr={0.35 / 3!r},momentum=0.9"
  assert outer_row.name.endswith(f"+ nesterov:lr={0.35 / 3!r},momentum=0.9")
  # the one whose pilot needed the fewest examples is a row of its own, with the same rule and rate, when it differs
  fewest = types.SimpleNamespace(**{**vars(tuned), "label": "short waves", "grouping": "0/1/2/3/4/5"})
  rows = tuned_specs(runner, tuned, tuned, runner.best_outer_rule(), tuned, fewest)
  assert [s.row for s in rows] == [TUNED, TUNED_OUTER, TUNED_EXAMPLES]
  assert rows[2].name.startswith("HetPipe tuned for examples (0/1/2/3/4/5, D=0) + nesterov:lr=")
  assert rows[2].setting.ps_optimizer == rows[1].setting.ps_optimizer and rows[2].lr_system == NESTEROV
  assert len(tuned_specs(runner, tuned, tuned, runner.best_outer_rule(), tuned, tuned)) == 2  # the same one


def test_the_outer_row_takes_the_rule_whose_pilots_ended_best(monkeypatch):
  runner, _ = small_runner(monkeypatch, Plain(), Plain())
  runner.config = ConvergenceConfig(MINI, seeds=(0,), outer="avg;heloco;delayed_nesterov")
  pilot = lambda system, final: LrPilot(system, GRID, 0.1, 1.0, 1.0, 1.0, 100, 0.5, final, final is None, [])
  avg, heloco, nesterov = (outer_system(r) for r in ("avg", "heloco", "delayed_nesterov"))
  runner.lr_pilots = [pilot(avg, 0.7), pilot(avg, 0.8), pilot(heloco, 0.85), pilot(heloco, None),
                      pilot(nesterov, 0.85), pilot(HETPIPE, 0.9)]
  assert runner.best_outer_rule() == "heloco"  # its best pilot, 0.85, ties delayed_nesterov's: the first given
  runner.config = ConvergenceConfig(MINI, seeds=(0,), outer="")
  assert runner.best_outer_rule() is None
  with pytest.raises(ConfigError, match=r"^--outer=avg;avg:lr=2: a rule is named twice; give each rule once"):
    ConvergenceConfig(MINI, outer="avg;avg:lr=2")


def test_a_rate_at_an_end_of_the_grid_is_flagged(monkeypatch):
  runner, _ = small_runner(monkeypatch, Recording(RULE * 100, 0.7), Plain(RULE / 100))
  runner.choose_learning_rates()
  assert runner.choices["local_sgd"].at_edge and runner.choices["local_sgd"].factor == pytest.approx(10.0)
  assert runner.choices["plain"].at_edge and runner.choices["plain"].factor < 0.1  # refined past the end
  assert not runner.choices[HETPIPE].at_edge
