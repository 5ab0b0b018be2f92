"""The parameter server's outer optimizer (``ps_optimizer``, ``--ps_optimizer``): its specs and their errors,
the sign of its step (Nesterov with lr 1 and momentum 0 is the plain add, bit for bit, end to end), pushes by
hand (averaging, Delayed Nesterov), and runs with it that the WSP checker accepts."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpipe_jax import ConfigError, ParameterServer, RunConfig, get_model, run_hetpipe, synthetic
from hetpipe_jax.optim import PSOptimizer, make_ps_optimizer, parse_ps_optimizer

from helpers import assert_trace_ok

MODEL, DATA = get_model("mlp"), synthetic(num_train=256, num_test=64)
SMALL = dict(cluster="hetero4", num_vws=2, stages=(2, 1), nm=(2, 3), d=1, waves=4, batch_size=16, eval_every=2)


# --- specs -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, parsed, canonical", [
    ("add", PSOptimizer("add"), "add"),
    (" add ", PSOptimizer("add"), "add"),
    ("sgd", PSOptimizer("sgd", 1.0), "sgd:lr=1.0"),
    ("sgd:lr=0.5", PSOptimizer("sgd", 0.5), "sgd:lr=0.5"),
    ("nesterov", PSOptimizer("nesterov", 0.7, 0.9), "nesterov:lr=0.7,momentum=0.9"),
    ("nesterov:momentum=0.5, lr=2", PSOptimizer("nesterov", 2.0, 0.5), "nesterov:lr=2.0,momentum=0.5"),
    ("momentum:lr=0.1,momentum=0", PSOptimizer("momentum", 0.1, 0.0), "momentum:lr=0.1,momentum=0.0"),
    ("avg", PSOptimizer("avg", 1.0), "avg:lr=1.0,share=1.0"),
    ("avg:share=0", PSOptimizer("avg", 1.0, share=0.0), "avg:lr=1.0,share=0.0"),
    ("delayed_nesterov:lr=0.5", PSOptimizer("delayed_nesterov", 0.5, 0.9),
     "delayed_nesterov:lr=0.5,momentum=0.9,share=1.0"),
    ("heloco:keep=0.25", PSOptimizer("heloco", 1.0, 0.9, keep=0.25),
     "heloco:lr=1.0,momentum=0.9,share=1.0,keep=0.25,shrink=1.0,cap=1.0,turn=0.5,kappa=1.0"),
])
def test_specs_parse_to_their_canonical_form(spec, parsed, canonical):
  assert parse_ps_optimizer(spec) == parsed and str(parsed) == canonical
  assert parse_ps_optimizer(canonical) == parsed
  assert make_ps_optimizer(spec) is make_ps_optimizer(canonical)  # one object per spec: configs compare equal
  assert parsed.slots == {"momentum": 1, "nesterov": 1, "delayed_nesterov": 2, "heloco": 1}.get(parsed.name, 0)
  assert (make_ps_optimizer(spec) is None) == (parsed.name == "add")


@pytest.mark.parametrize("spec, message", [
    ("adam", r"ps_optimizer='adam': unknown optimizer 'adam'; choose one of add, sgd, momentum, nesterov"),
    ("add:lr=1", r"add has no key 'lr'; it takes no keys"),
    ("sgd:momentum=0.9", r"sgd has no key 'momentum'; its keys are lr"),
    ("nesterov:beta=0.9", r"nesterov has no key 'beta'; its keys are lr, momentum"),
    ("nesterov:lr=1,lr=2", r"lr is given twice"),
    ("nesterov:lr", r"'lr' is not KEY=NUMBER"),
    ("nesterov:lr=fast", r"'lr=fast' is not KEY=NUMBER"),
    ("nesterov:lr=0", r"lr=0.0; the outer learning rate must be a finite number > 0"),
    ("sgd:lr=-1", r"lr=-1.0; the outer learning rate must be a finite number > 0"),
    ("nesterov:lr=inf", r"lr=inf; the outer learning rate must be a finite number > 0"),
    ("nesterov:lr=nan", r"lr=nan; the outer learning rate must be a finite number > 0"),
    ("nesterov:momentum=1", r"momentum=1.0; the outer momentum must be in \[0, 1\)"),
    ("momentum:momentum=-0.1", r"momentum=-0.1; the outer momentum must be in \[0, 1\)"),
    ("nesterov:momentum=nan", r"momentum=nan; the outer momentum must be in \[0, 1\)"),
    ("avg:share=0.5", r"share=0.5; give share=1 \(each push weighs its virtual worker's share of a round's examples"),
    ("heloco:keep=2", r"keep=2.0; HeLoCo's keep must be a finite number in \[-1, 1\] \(default 0.5\)"),
    ("heloco:cap=-1", r"cap=-1.0; HeLoCo's cap must be a finite number in \[0, inf\] \(default 1\)"),
    ("heloco:kappa=nan", r"kappa=nan; HeLoCo's kappa must be a finite number"),
])
def test_a_bad_spec_is_one_line_naming_it(spec, message):
  for check in (lambda: parse_ps_optimizer(spec), lambda: RunConfig.of(ps_optimizer=spec).validate()):
    with pytest.raises(ConfigError, match=message) as e:
      check()
    assert "\n" not in str(e.value) and repr(spec) in str(e.value)


def test_the_config_resolves_the_spec_into_the_servers_apply_rule():
  assert RunConfig().optim.server_rule(3) is None and RunConfig().optim.ps_spec == "add"
  config = RunConfig.of(ps_optimizer="nesterov")
  config.validate()
  assert config.optim.ps_spec == "nesterov:lr=0.7,momentum=0.9"
  assert config.optim.server_rule(2) is make_ps_optimizer("nesterov")  # what the executors pass
  assert config.optim.ps_tx is None  # no rule of one's own
  assert config == RunConfig.of(ps_optimizer="nesterov")
  assert config.replace(ps_optimizer="add") == RunConfig()
  assert config.replace(ps_optimizer="sgd:lr=2").optim.server_rule(2) is make_ps_optimizer("sgd:lr=2")
  # A rule of N virtual workers is built for the run's N.
  avg = RunConfig.of(ps_optimizer="avg").optim
  assert avg.server_rule(4) is make_ps_optimizer("avg", 4) and avg.server_rule(4) is not avg.server_rule(2)
  # A given ps_tx is kept with the default spec, and refused with another one.
  given = optax.trace(decay=0.5)
  assert RunConfig.of(ps_tx=given).optim.server_rule(2) is given
  with pytest.raises(ConfigError, match=r"^ps_tx and ps_optimizer='sgd:lr=2' both set the parameter server's apply "
                                        r"rule; drop one of them"):
    RunConfig.of(ps_tx=given, ps_optimizer="sgd:lr=2").validate()
  with pytest.raises(ConfigError, match=r"ps_optimizer='nesterov:lr=0'"):  # refused before anything runs
    run_hetpipe(MODEL, DATA, RunConfig.of(**SMALL, ps_optimizer="nesterov:lr=0"))
  with pytest.raises(ConfigError, match=r"^num_vws=0; the parameter server's rule needs at least 1 virtual worker"):
    make_ps_optimizer("avg", 0)


# --- the step at the parameter server ---------------------------------------------------------------------

def _params():
  return ({"w": jnp.asarray([[1.0, -2.0], [0.5, 4.0]])}, {"b": jnp.asarray([0.25, -1.5, 3.0])})


_D1 = ({"w": jnp.asarray([[0.1, -0.3], [0.7, 0.0]])}, {"b": jnp.asarray([-0.2, 0.05, 1.0])})
_D2 = ({"w": jnp.asarray([[-0.4, 0.2], [0.3, -0.6]])}, {"b": jnp.asarray([0.5, -0.25, 0.125])})


def _push_two(tx):
  """A server with ``tx``: VW 0 pushes wave 0 (delta _D1), then VW 1 wave 0 (_D2); the weights after each."""
  ps = ParameterServer(_params(), num_vws=2, d=1, tx=tx)
  ps.push(0, 0, dict(enumerate(_D1)))
  after_one = ps.params
  ps.push(1, 0, dict(enumerate(_D2)))
  return after_one, ps.params


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_nesterov_with_lr_1_and_momentum_0_is_the_plain_add_bit_for_bit():
  for spec in ("nesterov:lr=1,momentum=0", "momentum:lr=1,momentum=0", "sgd:lr=1"):
    for got, want in zip(_push_two(make_ps_optimizer(spec)), _push_two(None), strict=True):
      for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=spec)


@pytest.mark.parametrize("spec", ["nesterov:lr=0.5,momentum=0.9", "momentum:lr=0.5,momentum=0.9", "sgd:lr=0.5"])
def test_two_pushes_move_the_weights_as_computed_by_hand(spec):
  """The push is the summed weight change delta, the outer gradient -delta. By hand, with lr 0.5 and momentum
  0.9: Nesterov m1 = d1, W1 = W0 + lr (d1 + 0.9 m1); m2 = d2 + 0.9 m1, W2 = W1 + lr (d2 + 0.9 m2); heavy ball
  W1 = W0 + lr m1, W2 = W1 + lr m2; sgd W1 = W0 + lr d1, W2 = W1 + lr d2."""
  parsed = parse_ps_optimizer(spec)
  name, lr, mom = parsed.name, parsed.lr, parsed.momentum
  w0, d1, d2 = (np.concatenate([x.ravel() for x in _leaves(t)]).astype(np.float64) for t in (_params(), _D1, _D2))
  m1 = d1
  m2 = d2 + mom * m1 if name != "sgd" else d2
  step1 = {"nesterov": d1 + mom * m1, "momentum": m1, "sgd": d1}[name]
  step2 = {"nesterov": d2 + mom * m2, "momentum": m2, "sgd": d2}[name]
  w1 = w0 + lr * step1
  w2 = w1 + lr * step2
  got1, got2 = (np.concatenate([x.ravel() for x in _leaves(t)]) for t in _push_two(make_ps_optimizer(spec)))
  np.testing.assert_allclose(got1, w1, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got2, w2, rtol=1e-6, atol=1e-7)
  if name == "nesterov":  # the same numbers as w1 = 0.95 d1 and w2 = w1 + 0.95 d2 + 0.405 d1
    np.testing.assert_allclose(got2, w0 + 1.355 * d1 + 0.95 * d2, rtol=1e-6, atol=1e-7)
  assert not np.allclose(got2, w0 + d1 + d2)  # not the plain add


def test_nesterov_is_optax_sgd_with_nesterov_momentum_on_the_outer_gradient():
  """DiLoCo's outer step: ``optax.sgd(lr, momentum, nesterov=True)`` on the outer gradient -delta."""
  reference = optax.sgd(0.7, momentum=0.9, nesterov=True)
  w, state = _params(), reference.init(_params())
  for delta in (_D1, _D2):
    step, state = reference.update(jax.tree.map(jnp.negative, delta), state, w)
    w = optax.apply_updates(w, step)
  for a, b in zip(_leaves(_push_two(make_ps_optimizer("nesterov:lr=0.7,momentum=0.9"))[1]), _leaves(w),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _scalar_pushes(tx, deltas):
  """What ``tx`` adds to a scalar weight for each of ``deltas`` pushed in turn."""
  state, out = tx.init(jnp.zeros([])), []
  for delta in deltas:
    step, state = tx.update(jnp.asarray(delta, jnp.float32), state)
    out.append(float(step))
  return out


def test_averaging_scales_each_push_by_lr_over_n():
  np.testing.assert_allclose(_scalar_pushes(make_ps_optimizer("avg", 4), [2.0, -8.0]), [0.5, -2.0])
  np.testing.assert_allclose(_scalar_pushes(make_ps_optimizer("avg:lr=0.5", 2), [2.0, -8.0]), [0.5, -2.0])


def test_delayed_nesterov_steps_its_momentum_once_per_round_of_n_pushes_as_computed_by_hand():
  """N = 2, lr 1, momentum 0.5, pushes 2, 4, 6, 8: push 1 adds 2/2 = 1 (buffer 2); push 2 closes the round:
  m = 0.5 x 0 + (2 + 4)/2 = 3, adds 4/2 + 0.5 x 3 = 3.5; push 3 adds 6/2 = 3 (buffer 6); push 4: m = 0.5 x 3 +
  (6 + 8)/2 = 8.5, adds 8/2 + 0.5 x 8.5 = 8.25 (Liu et al. 2024, Algorithm 2, c = 0)."""
  tx = make_ps_optimizer("delayed_nesterov:lr=1,momentum=0.5", 2)
  np.testing.assert_allclose(_scalar_pushes(tx, [2.0, 4.0, 6.0, 8.0]), [1.0, 3.5, 3.0, 8.25])
  tx = make_ps_optimizer("delayed_nesterov:lr=0.1,momentum=0.5", 2)
  np.testing.assert_allclose(_scalar_pushes(tx, [2.0, 4.0, 6.0, 8.0]), [0.1, 0.35, 0.3, 0.825], rtol=1e-6)


def _pushes_by(tx, pushes):
  """What ``tx`` adds for each (virtual worker, delta) of ``pushes`` in turn (deltas: vectors)."""
  state, out = tx.init(jnp.zeros(len(pushes[0][1]))), []
  for vw, delta in pushes:
    step, state = tx.update(jnp.asarray(delta, jnp.float32), state, vw=np.int32(vw))
    out.append(np.asarray(step))
  return out


def test_averaging_weighs_each_push_by_its_virtual_workers_share_of_the_examples():
  """Waves of 2 and 6 minibatches: shares 1/4 and 3/4 (not 1/2 each); share=0 and equal waves: 1/2."""
  pushes = [(0, [4.0]), (1, [4.0]), (1, [-2.0])]
  np.testing.assert_allclose(_pushes_by(make_ps_optimizer("avg", 2, [2, 6]), pushes), [[1.0], [3.0], [-1.5]])
  np.testing.assert_allclose(_pushes_by(make_ps_optimizer("avg:lr=0.5", 2, [2, 6]), pushes), [[0.5], [1.5], [-0.75]])
  for tx in (make_ps_optimizer("avg:share=0", 2, [2, 6]), make_ps_optimizer("avg", 2, [3, 3])):
    np.testing.assert_allclose(_pushes_by(tx, pushes), [[2.0], [2.0], [-1.0]])
  assert make_ps_optimizer("avg", 2, [3, 3]) is make_ps_optimizer("avg", 2)  # equal waves: the plain 1/N rule
  with pytest.raises(ConfigError, match=r"^wave_examples=\[2\] for 2 virtual workers; give one count per"):
    make_ps_optimizer("avg", 2, [2])


def test_delayed_nesterov_weighs_a_round_of_pushes_by_their_shares_as_computed_by_hand():
  """N = 2, waves of 1 and 3 minibatches (shares 1/4, 3/4), lr 1, momentum 0.5; VW 1 pushes 4, VW 0 pushes 8, VW 1
  pushes 4, VW 1 pushes -4: push 1 adds 3/4 x 4 = 3 (buffer 3); push 2 closes the round: m = 3 + 8/4 = 5, adds
  8/4 + 0.5 x 5 = 4.5; push 3 adds 3 (buffer 3); push 4: m = 0.5 x 5 + 3 - 3 = 2.5, adds -3 + 0.5 x 2.5 = -1.75."""
  tx = make_ps_optimizer("delayed_nesterov:lr=1,momentum=0.5", 2, [1, 3])
  got = _pushes_by(tx, [(1, [4.0]), (0, [8.0]), (1, [4.0]), (1, [-4.0])])
  np.testing.assert_allclose(got, [[3.0], [4.5], [3.0], [-1.75]], rtol=1e-6)


def test_heloco_keeps_turns_and_shrinks_a_push_against_the_outer_momentum_as_computed_by_hand():
  """N = 1, lr 1, momentum 0.5, the defaults keep 0.5, shrink 1, cap 1, turn 0.5, kappa 1.
  Push (2, 0): the momentum is 0, kept: m = 0.5 x (2, 0) = (1, 0), adds (2, 0) + 0.5 m = (2.5, 0).
  Push (0, 2): cos 0 < keep, turned: conf = 2 / (2 + 1) = 2/3, lam = 0.5 x 1 x 2/3 = 1/3, direction (1/3, 2/3)
  rescaled to norm 2: G = (2, 4) / sqrt(5) = (0.894427, 1.788854); m = (0.5, 0) + G / 2 = (0.947214, 0.894427);
  adds G + m / 2 = (1.368034, 2.236068).
  Push (-4, 0): |m| = 1.302776, cos = -0.947214 / 1.302776 = -0.727075, conf = 4 / 5.302776 = 0.754322,
  beta = 0.727075 x 0.754322 = 0.548450, G = (-4, 0) - beta x cos x 4 x m / |m| = (-2.840274, 1.095104);
  m = m / 2 + G / 2 = (-0.946530, 0.994766); adds G + m / 2 = (-3.313539, 1.592487)."""
  tx = make_ps_optimizer("heloco:lr=1,momentum=0.5", 1)
  got = _pushes_by(tx, [(0, [2.0, 0.0]), (0, [0.0, 2.0]), (0, [-4.0, 0.0])])
  np.testing.assert_allclose(got, [[2.5, 0.0], [1.368034, 2.236068], [-3.313539, 1.592487]], rtol=2e-5, atol=2e-6)
  # Never corrected (keep -1): an exponential-mean Nesterov step; with two virtual workers each push weighs 1/2.
  got = _pushes_by(make_ps_optimizer("heloco:lr=1,momentum=0.5,keep=-1", 2), [(0, [2.0, 0.0]), (1, [0.0, 2.0])])
  np.testing.assert_allclose(got, [[1.25, 0.0], [0.125, 1.25]], rtol=1e-6)  # m = (0.5, 0), then (0.25, 0.5)


def test_delayed_nesterov_of_a_round_of_one_push_is_nesterov():
  deltas = [0.3, -1.2, 2.5, 0.7, -0.4]
  np.testing.assert_allclose(_scalar_pushes(make_ps_optimizer("delayed_nesterov:lr=0.7,momentum=0.9", 1), deltas),
                             _scalar_pushes(make_ps_optimizer("nesterov:lr=0.7,momentum=0.9"), deltas), rtol=1e-6)


# --- runs -------------------------------------------------------------------------------------------------

_RUNS = {}


def _run(executor="virtual", **kw):
  """A small run (each computed once per session), its trace checked with the WSP checker."""
  key = (executor, tuple(sorted(kw.items())))
  if key not in _RUNS:
    result = run_hetpipe(MODEL, DATA, RunConfig.of(**SMALL, executor=executor, **kw))
    assert_trace_ok(result.events)
    _RUNS[key] = result
  return _RUNS[key]


def test_nesterov_with_lr_1_and_momentum_0_runs_bit_identical_to_add():
  plain, outer = _run(), _run(ps_optimizer="nesterov:lr=1,momentum=0")
  assert "ps_optimizer" not in plain.events[0]  # a default run's meta line is as it was
  assert outer.events[0] == {**plain.events[0], "ps_optimizer": "nesterov:lr=1.0,momentum=0.0"}
  assert outer.events[1:] == plain.events[1:]
  for a, b in zip(jax.tree.leaves(outer.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for vw_a, vw_b in zip(outer.vws, plain.vws, strict=True):
    for sa, sb in zip(vw_a.stages, vw_b.stages, strict=True):
      for a, b in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert outer.metrics == plain.metrics


def test_an_outer_nesterov_step_changes_the_training_and_keeps_the_protocol():
  plain, outer = _run(), _run(ps_optimizer="nesterov:lr=0.7,momentum=0.9")
  assert outer.events[0]["ps_optimizer"] == "nesterov:lr=0.7,momentum=0.9"
  # The schedule, the clocks and every weight version are the same: the rule changes the numbers only.
  assert outer.events[1:] == plain.events[1:]
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(outer.params), jax.tree.leaves(plain.params), strict=True))
  assert diff > 1e-3
  assert all(np.isfinite(r["train_loss"]) for r in outer.metrics)


def test_the_wall_executor_runs_the_outer_optimizer_under_the_checker():
  result = _run(executor="wall", ps_optimizer="momentum:lr=0.5,momentum=0.5")
  assert result.events[0]["ps_optimizer"] == "momentum:lr=0.5,momentum=0.5"
  assert all(np.isfinite(r["train_loss"]) for r in result.metrics)


def test_the_sim_executor_accepts_the_flag_and_its_timing_does_not_change():
  plain, outer = _run(executor="sim"), _run(executor="sim", ps_optimizer="nesterov")
  assert outer.seconds == plain.seconds
  assert outer.events[1:] == plain.events[1:]


@pytest.mark.parametrize("spec", ["avg:lr=0.9", "delayed_nesterov:lr=0.8,momentum=0.9"])
def test_the_rules_of_a_round_run_under_the_checker_and_change_only_the_numbers(spec):
  plain, outer = _run(), _run(ps_optimizer=spec)
  assert outer.events[0]["ps_optimizer"] == str(parse_ps_optimizer(spec))
  assert outer.events[1:] == plain.events[1:]
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(outer.params), jax.tree.leaves(plain.params), strict=True))
  assert diff > 1e-4
  assert all(np.isfinite(r["train_loss"]) for r in outer.metrics)
