"""RunConfig's parts: flat names and parts build the same config, and each part validates itself."""

import dataclasses

import pytest

from hetpipe_jax import ConfigError, RunConfig
from hetpipe_jax.run.config import FLAT, CheckpointSpec, Faults, LayoutSpec, OptimizerSpec, WallOptions, WSPSpec
from hetpipe_jax.run.executors import EXECUTORS, get_executor
from hetpipe_jax.sim import SimOptions


def test_flat_names_and_parts_build_the_same_config():
  nested = RunConfig(waves=5, layout=LayoutSpec(num_vws=2, nm=(2, 3)), wsp=WSPSpec(d=0, schedule="fifo"),
                     optim=OptimizerSpec(name="adam", learning_rate=0.01), sim=SimOptions(staged_ps=True))
  flat = RunConfig.of(waves=5, num_vws=2, nm=(2, 3), d=0, schedule="fifo", optimizer="adam", learning_rate=0.01,
                      staged_ps=True)
  assert nested == flat
  assert flat.replace(d=3).wsp == WSPSpec(d=3, schedule="fifo") and flat.wsp.d == 0  # frozen: a new config
  assert flat.replace(wsp=WSPSpec(d=2)).wsp.d == 2  # a whole part by its name


def test_every_flat_name_is_a_field_of_its_part():
  parts = {f.name: f.type for f in dataclasses.fields(RunConfig)}
  for name, (part, field) in FLAT.items():
    assert part in parts, name
    assert field in {f.name for f in dataclasses.fields(getattr(RunConfig(), part))}, name


@pytest.mark.parametrize("part, call, message", [
    (WSPSpec(d=-1), lambda p: p.validate(), r"D=-1; the clock distance bound must be >= 0"),
    (LayoutSpec(placement="nearby"), lambda p: p.validate(), r"unknown placement 'nearby'"),
    (LayoutSpec(time_model="bert"), lambda p: p.validate(), r"time_model='bert'; use one of"),
    (OptimizerSpec(learning_rate=float("inf")), lambda p: p.validate(), r"learning_rate=inf; use a finite"),
    (OptimizerSpec(on_nonfinite="ignore"), lambda p: p.validate(), r"unknown on_nonfinite 'ignore'"),
    (Faults(failures=((0, 9),)), lambda p: p.validate(waves=5), r"fail=0@9: the wave must be in 0..4"),
    (CheckpointSpec(resume=True), lambda p: p.validate(None), r"resume needs checkpoint_dir"),
    (CheckpointSpec(directory="/tmp/x"), lambda p: p.validate(None), r"checkpoint_dir needs trace_path"),
    (WallOptions(time_scale=float("nan")), lambda p: p.validate(), r"time_scale=nan; use 0"),
])
def test_each_part_validates_itself(part, call, message):
  with pytest.raises(ConfigError, match=message):
    call(part)


def test_each_executor_refuses_what_it_does_not_run():
  assert sorted(EXECUTORS) == ["multiprocess", "sim", "virtual", "wall"]
  with pytest.raises(ConfigError, match=r"unknown executor 'gpu'; choose one of virtual, wall, sim, multiprocess"):
    get_executor("gpu")
  for name in ("virtual", "wall", "multiprocess"):
    with pytest.raises(ConfigError, match=rf"overlap_transfers is a model of the sim executor; the {name} executor"):
      get_executor(name).validate(RunConfig.of(executor=name, overlap_transfers=True))
  with pytest.raises(ConfigError, match=r"checkpoints are for runs with numerics; the sim executor has none"):
    get_executor("sim").validate(RunConfig.of(executor="sim", checkpoint_dir="/tmp/x", trace_path="/tmp/t"))
  get_executor("sim").validate(RunConfig.of(executor="sim", overlap_transfers=True, fast_sim=True,
                                            precision="bf16"))  # all the sim's own: accepted
