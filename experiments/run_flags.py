r"""A run's settings as absl flags, each declared once: what every script that runs HetPipe imports.

A setting of a run is a field of :class:`~hetpipe_jax.RunConfig` or of one of its parts, with its default and
its help declared there (:func:`hetpipe_jax.run.config.settings`); the few a run takes beside its config (the
model, the dataset, a full-size GPT's sequence length) are declared here (:data:`BESIDE`). A script defines the
flags it takes, then builds its config from them in its ``main``::

  run_flags.define(overrides={"waves": 120})                # experiments/train.py: every setting
  run_flags.define(["batch_size", "optimizer"], overrides={"optimizer": "sgd"})   # a study: the ones it varies

  def main(argv):
    config = run_flags.run_config(FLAGS, **run_flags.layout(FLAGS), trace_path=...)

A flag takes its setting's flat name and value, except where the command line spells it otherwise
(:data:`SPELLINGS`): lists of integers (``--stages=2,1``, ``--nm=3,2,1``, ``--window``), ``--cuts=0,1,5;0,3,5``,
a policy's name or a grouping (``--policy=0,1;2,3``), a repeatable ``--fail=VW@WAVE`` for the failures and
``--on_nonfinite`` among its choices. The layout's flags are read together (:func:`layout`): a policy lets the
planner decide what the others would.

Importing this module imports JAX; a script sets JAX's CPU device count after that, before JAX computes
(:func:`experiments.common.ensure_devices`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from absl import flags

from experiments import common
from hetpipe_jax import RunConfig, get_cluster
from hetpipe_jax.plan.allocation import parse_policy
from hetpipe_jax.plan.partition import NM_POLICIES
from hetpipe_jax.plan.tensor_groups import parse_tp
from hetpipe_jax.run.config import Setting, settings
from hetpipe_jax.runtime.numerics.ps import ON_NONFINITE

# What a run takes beside its config.
BESIDE = (
    Setting("model", "cnn", "Model: mlp, cnn, vgg, resnet, gpt (on --dataset=tokens or text); with --executor=sim "
            "also the full-size vgg19, resnet152, gpt2-xl, gpt-6.7b, gpt-13b; or package.module:factory, a function "
            "of yours that builds the model (hetpipe_jax.from_modules), importable in every process (e.g. "
            "examples.residual_mlp:model)."),
    Setting("dataset", "auto", "Dataset: auto (Fashion-MNIST, else digits; experiments.train's gpt and gpt6: text, "
            "else tokens), fashion_mnist, digits, synthetic, tokens "
            "(a synthetic language for --model=gpt), text (English text byte by byte for --model=gpt: Debian's "
            "fortunes, apt-get install -y fortunes)."),
    Setting("seq_len", None, "Full-size GPT models (sim): tokens per sequence (default: the context)."),
)

# The layout's settings, read together by layout().
LAYOUT = ("num_vws", "stages", "nm", "window", "cuts", "policy")


def parse_failures(values: Sequence[str]) -> list[tuple[int, int]]:
  """``--fail`` values ``VW@WAVE`` as (virtual worker, wave) pairs.

  Raises:
    ConfigError: for a value that is not two non-negative integers around '@'.
  """
  out = []
  for value in values:
    vw, sep, wave = value.partition("@")
    if not sep or not vw.strip().isdigit() or not wave.strip().isdigit():
      raise common.config_error(f"--fail={value}; write VW@WAVE with two non-negative integers, e.g. "
                                "--fail=1@5")
    out.append((int(vw), int(wave)))
  return out


def parse_slow(values: Sequence[str]) -> list[tuple[int, float, float, float]]:
  """``--slow`` values ``NODE:FACTOR@START-END`` as (node, factor, start, end).

  Raises:
    ConfigError: for a value not of that form.
  """
  out = []
  for value in values:
    match = re.fullmatch(r"\s*(\d+):([\d.eE+]+)@([\d.eE+]+)-([\d.eE+]+)\s*", value)
    try:
      parsed = None if match is None else (int(match[1]), float(match[2]), float(match[3]), float(match[4]))
    except ValueError:
      parsed = None
    if parsed is None:
      raise common.config_error(f"--slow={value}; write NODE:FACTOR@START-END, e.g. --slow=2:3@10-40 (node 2's "
                                "tasks 3 times as long from 10 s to 40 s of training)")
    out.append(parsed)
  return out


class Spelling(NamedTuple):
  """How the command line spells a setting whose value is not one number, string or switch.

  Attributes:
    kind: the absl flag type (``list``, ``string``, ``integer``, ``multi_string``, ``enum``).
    flag: the flag's name when not the setting's.
    choices: an enum's values.
    parse: the flag's value -> the setting's (None: the layout's, read by :func:`layout`, or the value itself).
  """

  kind: str
  flag: str | None = None
  choices: Sequence[str] = ()
  parse: Callable[[Any], Any] | None = None


SPELLINGS = {
    "stages": Spelling("list"), "nm": Spelling("list"), "window": Spelling("list"), "cuts": Spelling("string"),
    "policy": Spelling("string"), "checkpoint_dir": Spelling("string"), "seq_len": Spelling("integer"),
    "failures": Spelling("multi_string", "fail", parse=parse_failures),
    "slow": Spelling("multi_string", parse=parse_slow),
    "on_nonfinite": Spelling("enum", choices=ON_NONFINITE), "tp": Spelling("string", parse=parse_tp),
}
_KINDS = ((bool, "bool"), (int, "integer"), (float, "float"), (str, "string"))  # bool first: a bool is an int
_DEFINE = {"bool": flags.DEFINE_bool, "integer": flags.DEFINE_integer, "float": flags.DEFINE_float,
           "string": flags.DEFINE_string, "list": flags.DEFINE_list, "multi_string": flags.DEFINE_multi_string}


def spelling(setting: Setting) -> Spelling:
  """How the command line spells ``setting`` (a scalar: by its default's type)."""
  if setting.name in SPELLINGS:
    return SPELLINGS[setting.name]
  return Spelling(next(kind for t, kind in _KINDS if isinstance(setting.default, t)))


def flag_name(name: str) -> str:
  """The flag of the setting ``name`` (``fail`` for ``failures``; else the name itself)."""
  return SPELLINGS[name].flag or name if name in SPELLINGS else name


def all_settings() -> dict[str, Setting]:
  """Every setting a flag can set, by name: the config's and the ones beside it."""
  return {s.name: s for s in (*settings(), *BESIDE)}


def _flag_default(kind: str, default: Any) -> Any:
  """A setting's default as its flag's (a list flag's: strings)."""
  if kind == "multi_string":
    return list(default)
  if kind == "string" and default is not None:
    return str(default)
  if kind == "list" and default is not None:
    return [str(v) for v in (default if isinstance(default, (list, tuple)) else [default])]
  return default


def define(names: Sequence[str] | None = None, overrides: Mapping[str, Any] | None = None,
           flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines the flags of the settings ``names`` (None: every one) with their declared defaults.

  Args:
    names: settings by name (:func:`all_settings`).
    overrides: a script's own default for some of them, e.g. ``{"optimizer": "sgd"}``.
    flag_values: where to define them.

  Raises:
    ValueError: for a name no setting has, or an override of a setting not defined.
  """
  table = all_settings()
  names = list(table) if names is None else list(names)
  overrides = dict(overrides or {})
  unknown = [n for n in (*names, *overrides) if n not in table]
  if unknown or not set(overrides) <= set(names):
    raise ValueError(f"run_flags.define: unknown settings {unknown} or overrides {sorted(overrides)} of settings "
                     f"not in {names}; settings: {', '.join(table)}")
  for name in names:
    setting, spell = table[name], spelling(table[name])
    default = _flag_default(spell.kind, overrides.get(name, setting.default))
    if spell.kind == "enum":
      flags.DEFINE_enum(flag_name(name), default, list(spell.choices), setting.help, flag_values=flag_values)
    else:
      _DEFINE[spell.kind](flag_name(name), default, setting.help, flag_values=flag_values)


def run_config(flag_values: flags.FlagValues, **given: Any) -> RunConfig:
  """The RunConfig of the parsed flags: every config setting whose flag is defined (the layout's excepted: give
  them, from :func:`layout`), and the fields ``given`` (e.g. ``trace_path``); a setting without a flag keeps its
  declared default."""
  values = {}
  for setting in settings():
    flag = flag_name(setting.name)
    if setting.name in LAYOUT or setting.name in given or flag not in flag_values:
      continue
    parse = spelling(setting).parse
    values[setting.name] = flag_values[flag].value if parse is None else parse(flag_values[flag].value)
  return RunConfig.of(**values, **given)


def _planned_shape(flag_values: flags.FlagValues, policy) -> tuple[object, list[list[int]] | None]:
  """(Nm, cuts) of a run whose ``--policy`` lets the planner lay it out (a grouping with ``--cuts`` is an
  explicit layout, cut as given).

  Raises:
    ConfigError: for flags the planner would override.
  """
  fv = flag_values
  given = [f"--{name}" for name in ("num_vws", "stages") if fv[name].present]
  if isinstance(policy, str) and fv.cuts:
    given.append("--cuts")
  if given:
    raise common.config_error(f"--policy={fv.policy} lets the planner choose the virtual workers, their stages "
                              f"and cuts; drop {', '.join(given)} (a grouping of GPU indices with --cuts is taken "
                              "as given)")
  if fv.cuts:  # a grouping in pipeline order, cut as given: an explicit layout (a tuned plan)
    nms = common.parse_ints("nm", fv.nm)
    return (nms[0] if len(nms) == 1 else nms), common.parse_cuts(fv.cuts, len(policy))
  if len(fv.nm) > 1 and isinstance(policy, str):
    raise common.config_error(f"--nm={','.join(fv.nm)} gives one Nm per virtual worker, but with --policy the "
                              "planner decides the virtual workers; give one value: a number or "
                              f"{', '.join(NM_POLICIES)}")
  if len(fv.nm) > 1:
    return common.parse_ints("nm", fv.nm), None
  nm_rule = fv.nm[0] if fv["nm"].present else "max_fit"
  return (nm_rule if nm_rule in NM_POLICIES else common.parse_ints("nm", fv.nm)[0]), None


def _one_or_all(values: list[int] | None) -> int | list[int] | None:
  return values[0] if values and len(values) == 1 else values


def layout(flag_values: flags.FlagValues) -> dict[str, Any]:
  """The layout's flags (:data:`LAYOUT`) as RunConfig fields.

  Raises:
    ConfigError: for a value that is not one, or flags a policy's planner would override.
  """
  fv = flag_values
  policy = parse_policy(fv.policy) if fv.policy else None
  stages = common.parse_ints("stages", fv.stages)
  if policy is not None:
    nm, cuts = _planned_shape(fv, policy)
  else:  # a planner's Nm rule goes on to RunConfig, which refuses it without a policy
    rule = fv.nm[0] if len(fv.nm) == 1 and fv.nm[0] in NM_POLICIES else None
    nm, cuts = rule or _one_or_all(common.parse_ints("nm", fv.nm)), None
    if fv.cuts:
      cuts = common.parse_cuts(fv.cuts, fv.num_vws)
      if not fv["stages"].present:  # the cuts say how many stages
        stages = [len(c) - 1 for c in cuts]
        stages = stages[:1] if len(set(stages)) == 1 else stages
  window = common.parse_ints("window", fv.window) if fv.window else None
  return dict(num_vws=fv.num_vws, stages=_one_or_all(stages), nm=nm, cuts=cuts, window=_one_or_all(window),
              policy=policy)


def devices(config: RunConfig) -> int:
  """The emulated GPUs a run on one host lays out: the cluster's under a policy, else N x the most stages."""
  spec = config.layout
  if spec.policy is not None:
    return get_cluster(config.cluster).num_gpus if isinstance(config.cluster, str) else config.cluster.num_gpus
  stages = spec.stages if isinstance(spec.stages, int) else max(spec.stages)
  return spec.num_vws * stages * int(spec.tp)
