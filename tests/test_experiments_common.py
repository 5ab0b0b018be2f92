"""The glue the experiment scripts share (experiments/common.py): flag parsing, errors, files, trace check."""

import csv
import json
import os

import pytest

from experiments import common
from hetpipe_jax import ConfigError

from helpers import one_minibatch_trace


def test_parse_ints_names_the_flag_and_its_value():
  assert common.parse_ints("stages", ["2", "4"]) == [2, 4]
  with pytest.raises(ConfigError, match=r"^--nm=2,x must be integers, e.g. --nm=2 or --nm=2,4$"):
    common.parse_ints("nm", ["2", "x"])


def test_parse_nm_keeps_planner_rules():
  assert common.parse_nm("3") == 3
  assert common.parse_nm("max_fit") == "max_fit"


def test_one_cuts_list_is_every_virtual_workers():
  cuts = common.parse_cuts("0,2,5", 3)
  assert cuts == [[0, 2, 5]] * 3
  cuts[0].append(7)  # each virtual worker gets its own list
  assert cuts[1] == [0, 2, 5]
  assert common.parse_cuts("0,1,5;0,3,5", 2) == [[0, 1, 5], [0, 3, 5]]
  with pytest.raises(ConfigError, match=r"--cuts=0,1,5;0,3,5 gives 2 lists of boundaries for --num_vws=3"):
    common.parse_cuts("0,1,5;0,3,5", 3)
  with pytest.raises(ConfigError, match=r"--cuts=0,a,5 must be integer unit boundaries"):
    common.parse_cuts("0,a,5", 1)


@pytest.mark.parametrize("seed", [-5, -1, 2**63])
def test_seed_out_of_range_names_value_and_limit(seed):
  with pytest.raises(ConfigError, match=rf"^--seed={seed}; a seed must be in \[0, 2\*\*63 - 1\]"):
    common.check_seed(seed)


def test_seed_in_range_passes():
  assert common.check_seed(0) == 0
  assert common.check_seed(2**63 - 1) == 2**63 - 1


def test_entry_turns_a_config_error_into_one_line():
  def main(argv):
    raise ConfigError(f"D=-1 from {argv}; the clock distance bound must be >= 0")

  with pytest.raises(SystemExit) as exit_info:
    common.entry(main)(["prog"])
  assert exit_info.value.code == "error: D=-1 from ['prog']; the clock distance bound must be >= 0"
  assert common.entry(lambda argv: 0)(["prog"]) == 0


def test_entry_lets_bugs_through():
  def main(argv):
    raise KeyError("a bug, not a configuration")

  with pytest.raises(KeyError):
    common.entry(main)([])


def test_require_wsp_raises_on_a_broken_trace_and_passes_a_sound_one():
  events = one_minibatch_trace()
  common.require_wsp(events, "sound run")
  with pytest.raises(common.TraceCheckError, match=r"^unpushed run: the trace breaks WSP, 1 violations; first: "):
    common.require_wsp(events[:-1], "unpushed run")


def test_output_files(tmp_path, capsys):
  out = str(tmp_path / "a" / "b")
  path = common.output_path(out, "x.json")
  assert path == os.path.join(out, "x.json") and os.path.isdir(out)
  assert common.output_path(out, "x.json", str(tmp_path / "c" / "given.json")).endswith("given.json")
  assert os.path.isdir(tmp_path / "c")
  common.write_json(path, {"a": [1, 2]})
  assert json.loads((tmp_path / "a" / "b" / "x.json").read_text()) == {"a": [1, 2]}
  rows = [{"model": "vgg19", "ips": 1.5}, {"model": "resnet152", "ips": 2.0}]
  common.write_jsonl(common.output_path(out, "r.jsonl"), rows)
  assert [json.loads(line) for line in (tmp_path / "a" / "b" / "r.jsonl").read_text().splitlines()] == rows
  common.write_dict_csv(common.output_path(out, "r.csv"), rows)
  with open(os.path.join(out, "r.csv"), newline="", encoding="utf-8") as f:
    assert list(csv.reader(f)) == [["model", "ips"], ["vgg19", "1.5"], ["resnet152", "2.0"]]
  common.print_outputs([("json", path), ("timeline", "t.png")])
  lines = capsys.readouterr().out.splitlines()
  assert lines == [f"json     {os.path.abspath(path)}", f"timeline {os.path.abspath('t.png')}"]
