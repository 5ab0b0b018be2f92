r"""HetPipe adapting live across processes against a slowdown known in advance (issue 39's third goal).

One virtual worker of two stages on two processes (``tests/data/two_nodes.toml``: one GPU per node, of two types), the
residual MLP of ``examples/residual_mlp.py`` with ten blocks (12 units) on the digits, Nm = 4, D = 0, every task padded
to its emulated duration x ``--time_scale`` (CPU emulation: the padding, not this machine's speed, sets the pace). Node
``--node``'s process is slowed ``--factor`` times (``--slow``: a real delay per task) for the middle third of the run.
Four runs of ``--waves`` waves through the training CLI, each a real multi-process job with its trace checked:

1. *fast*: no slowdown, the planner's layout A; its images/s R_fast.
2. *slowed, known*: the slowdown for the whole run, with the layout B the planner gives when it knows the node's
   GPU is ``--factor`` times slower (the same rule the adaptation uses, on the true speeds); its images/s R_slow.
3. *adapting*: the slowdown for the middle third (its window from runs 1 and 2: T = images / (2/3 R_fast + 1/3
   R_slow), the window [T/3, 2T/3]), ``--adapt=on --replan_every=...``: re-planned from measured task times.
4. *static*: the same window, ``--adapt=off`` (what adapting buys).

Known in advance, the run would have gone at R_fast outside the window and R_slow inside it, with no cost to
switch: over the adapting run's T seconds, of which w in the window, (R_fast (T - w) + R_slow w) / T images/s.
The goal: the adapting run's images/s at least 0.8 of that. The last line is machine-readable::

  live_adapt_ratio=<adapting / known in advance> static_ratio=<static / known in advance> replans=<n>

  python -m experiments.bench_live_adapt
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import NamedTuple

from absl import flags

from experiments import common
from hetpipe_jax import RunConfig, get_model, load_dataset
from hetpipe_jax.errors import RunStopped
from hetpipe_jax.run.executors.sim import job as sim_job
from hetpipe_jax.run.setup import prepare
from hetpipe_jax.sim.replan import Replanning, better_layout

MODEL, DATASET, CLUSTER = "examples.residual_mlp:deep", "digits", os.path.join("tests", "data", "two_nodes.toml")

_WAVES = flags.DEFINE_integer("waves", 60, "Waves of every run.")
_REPLAN_EVERY = flags.DEFINE_integer("replan_every", 2, "The adapting run decides every this many waves.")
_TIME_SCALE = flags.DEFINE_float("time_scale", 1e4, "Every task padded to its emulated duration x this.")
_FACTOR = flags.DEFINE_float("factor", 3.0, "How many times slower the slowed process runs its tasks.")
_NODE = flags.DEFINE_integer("node", 0, "The node whose process is slowed.")
_OUT = flags.DEFINE_string("out_dir", None, "Where the runs write (default: a temporary folder).")


class Ran(NamedTuple):
  """One run: its images/s, seconds, pushed images and its parts' cuts (one entry without adaptation)."""

  rate: float
  seconds: float
  images: int
  cuts: list[list[list[int]]]


def _flags() -> list[str]:
  return ["--executor=multiprocess", f"--model={MODEL}", f"--dataset={DATASET}", f"--cluster={CLUSTER}",
          "--num_vws=1", "--stages=2", "--nm=4", "--d=0", f"--waves={_WAVES.value}",
          f"--time_scale={_TIME_SCALE.value:g}"]


def _train(out_dir: str, extra: Sequence[str]) -> Ran:
  """One run through the training CLI (it launches the processes); its trace must check."""
  proc = subprocess.run([sys.executable, "-m", "experiments.train", f"--out_dir={out_dir}", *_flags(), *extra],
                        capture_output=True, text=True, timeout=900, env=common.child_environment())
  if proc.returncode != 0 or "trace check: OK" not in proc.stdout:
    raise RunStopped(f"run {' '.join(extra)} failed: {proc.stderr.strip().splitlines()[-1:]}")
  with open(os.path.join(out_dir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(out_dir, "trace.jsonl")) as f:
    meta = json.loads(f.readline())
  cuts = [s["cuts"] for s in meta["segments"]] if "segments" in meta else [meta["cuts"]]
  return Ran(summary["images_per_second"], summary["seconds"], round(summary["images_per_second"] *
                                                                     summary["seconds"]), cuts)


def known_cuts() -> str:
  """Layout B: the cuts the adaptation's rule gives when it knows node ``--node``'s GPUs are ``--factor`` times
  slower (on the true speeds, any gain, for a long run)."""
  config = RunConfig.of(cluster=CLUSTER, num_vws=1, stages=2, nm=4, d=0, waves=_WAVES.value)
  setup = prepare(get_model(MODEL), load_dataset(DATASET), config)
  slowness = {g.index: _FACTOR.value for g in setup.cluster.gpus if g.node == _NODE.value}
  better = better_layout(sim_job(setup), setup.costs, Replanning(gain=0.0), slowness, 10**6)
  return ",".join(map(str, (better or setup.layout).cuts[0]))


def main(argv) -> None:
  del argv
  out = _OUT.value or tempfile.mkdtemp(prefix="bench_live_adapt_")
  node, factor = _NODE.value, _FACTOR.value
  fast = _train(os.path.join(out, "fast"), [])
  cuts_b = known_cuts()
  slowed = _train(os.path.join(out, "slowed"), [f"--slow={node}:{factor:g}@0-1e9", f"--cuts={cuts_b}"])
  t = fast.images / (2 / 3 * fast.rate + 1 / 3 * slowed.rate)
  window = f"--slow={node}:{factor:g}@{t / 3:.3f}-{2 * t / 3:.3f}"
  adapting = _train(os.path.join(out, "adapting"), [window, "--adapt=on", f"--replan_every={_REPLAN_EVERY.value}"])
  static = _train(os.path.join(out, "static"), [window])
  print(f"fast (layout A {fast.cuts[0][0]}): {fast.rate:.1f} images/s; slowed x{factor:g} for the whole run, "
        f"layout B {slowed.cuts[0][0]}: {slowed.rate:.1f} images/s")
  print(f"window [{t / 3:.2f}, {2 * t / 3:.2f}] s")
  ratios = []
  for name, run in (("adapting", adapting), ("static", static)):
    w = max(min(2 * t / 3, run.seconds) - t / 3, 0.0)
    known = (fast.rate * (run.seconds - w) + slowed.rate * w) / run.seconds
    ratios.append(run.rate / known)
    print(f"{name}: {run.rate:.1f} images/s over {run.seconds:.2f} s ({w / run.seconds:.2f} of it slowed); known in "
          f"advance {known:.1f} images/s; ratio {run.rate / known:.3f}")
  changes = sum(a != b for a, b in zip(adapting.cuts, adapting.cuts[1:]))
  print("adapting run's parts: " + " ".join(str(c[0]) for c in adapting.cuts))
  print(f"live_adapt_ratio={ratios[0]:.3f} static_ratio={ratios[1]:.3f} replans={changes}")


cli = common.console(main)

if __name__ == "__main__":
  cli()
