"""One row of the scaling study timed on its own (issue 42): ResNet-152's tuned 64-GPU configuration replicated
on mixed<N>x8, the whole row (:func:`hetpipe_jax.studies.scale.scale_row`: planning, the simulations of its
placement, striped and default, and their checks), its check's share and the process's peak memory. One row per
process, so each peak is its own; the 64-GPU tuning is done once and saved::

  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py tune            # writes outputs/scale_row/tuned64.pkl
  PYTHONPATH=. .venv/bin/python benchmarks/scale_row.py 1024            # RESULT gpus=1024 row=... check=...

With ``PYTHONPATH`` at a checkout of older code it times that code (where the study checked inside its
simulations, the check is timed apart by wrapping ``require_wsp``): the side-by-side figures of BUILD_NOTES.md.
"""

import os
import pickle
import resource
import sys
import time

from hetpipe_jax.cost.context import CostContext
from hetpipe_jax.studies import scale
from hetpipe_jax.tune import RunSetting

TUNED = os.path.join("outputs", "scale_row", "tuned64.pkl")


def main(argv: list[str]) -> None:
  setting = RunSetting(CostContext(optimizer_slots=1.0, precision="fp32"))
  profiles = scale.full_size_profiles("resnet152", 32, seq_len=None)
  config = scale.ScaleConfig(models=("resnet152",), sizes=(64,))
  if argv[1] == "tune":
    os.makedirs(os.path.dirname(TUNED), exist_ok=True)
    with open(TUNED, "wb") as f:
      pickle.dump(scale.tune_bases(config, "resnet152", profiles, setting)[64], f)
    return
  with open(TUNED, "rb") as f:
    tuned = pickle.load(f)  # noqa: S301 (our own file)
  checked = [0.0]
  if hasattr(scale, "require_wsp"):  # older code: the check inside each simulation
    inner = scale.require_wsp

    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      inner(*args, **kwargs)
      checked[0] += time.perf_counter() - t0

    scale.require_wsp = timed
  n = int(argv[1])
  t0 = time.perf_counter()
  row = scale.scale_row(config, "resnet152", n, tuned, profiles, setting)
  wall = time.perf_counter() - t0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"RESULT gpus={n} row={wall:.2f} check={getattr(row, 'check_seconds', checked[0]):.2f} "
        f"plan={row.plan_seconds:.2f} printed={row.plan_sim_seconds:.2f} peak_mb={peak:.0f} eff={row.efficiency:.4f} "
        f"striped={row.items_per_sec_striped:.1f} per_unit={row.items_per_sec_per_unit:.1f}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
