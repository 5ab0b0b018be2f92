r"""The benchmark suite on a git ref and on the working tree, side by side in one run: one ratio per benchmark.

Timings on a shared 2-core machine drift by tens of percent from one minute to the next, so a ratio only
means something when both sides are measured now, here, under the same conditions. This script checks REF
out into a temporary git worktree (``git worktree add --detach``, removed at the end), then runs the suite
of this folder (always the working tree's files) alternately on REF's package and on the working tree's:
round 1 REF then the working tree, round 2 the other way round, ... Each run is a fresh
``python -P -m pytest benchmarks`` with the tree first on ``PYTHONPATH`` (so REF needs no ``benchmarks/`` of
its own), ``PYTHONHASHSEED=0``, one JAX compilation cache for all runs and a profile cache (and ``HOME``)
of each side's own. Per benchmark it prints REF's time, the working tree's, and working/REF, flagging
ratios above ``--threshold``; the statistic is the minimum over all rounds (``--stat`` for another). A
benchmark whose API REF lacks is skipped there, with the reason. The wall executor's host overhead per
task (its run minus the same stage programs back to back, over its tasks) is derived from two benchmarks.

Usage (from the repository root)::

  benchmarks/compare.sh                 # REF = HEAD: what the uncommitted changes did
  benchmarks/compare.sh 098139c --rounds=3 -k "sim or wall"
  benchmarks/compare.sh --save=base.json          # the working tree only: save a baseline
  benchmarks/compare.sh --baseline=base.json      # the working tree only: ratios against the baseline
  benchmarks/compare.sh main --ref-tree=/path/to/checkout   # REF already checked out there
  benchmarks/compare.sh 098139c --work-tree=/path/to/HEAD-checkout   # two commits, neither the working tree

A saved baseline is not a side-by-side measurement: compare against it only on the same machine, soon.
Exit status 0, or 1 with ``--fail`` when a ratio is above the threshold, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STATS = ("min", "median", "mean")
# Derived figures: name -> (benchmark, baseline benchmark, extra_info key to divide by, unit scale, unit).
DERIVED = {"wall overhead per task": ("test_wall_executor", "test_wall_stage_programs", "tasks", 1e6, "us")}


def git(root: str, *args: str) -> str:
  return subprocess.run(["git", "-C", root, *args], check=True, capture_output=True, text=True).stdout.strip()


def run_suite(tree: str, tmp: str, tag: str, select: str | None, timeout: float) -> dict:
  """One pytest run of the suite on ``tree``'s package; returns {name: {stats..., extra_info}} plus the
  skips and failures under the keys "_skipped" and "_failed"."""
  out, notes, log = (os.path.join(tmp, f"{tag}.{ext}") for ext in ("json", "notes.jsonl", "log"))
  # HOME and HETPIPE_JAX_CACHE of each side's own: a tree's profile cache (~/.cache/hetpipe_jax before
  # $HETPIPE_JAX_CACHE) may hold files of a format another tree cannot read.
  side = os.path.join(tmp, tag.rstrip("0123456789"))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])]),
             HETPIPE_BENCH_TREE=tree, HETPIPE_BENCH_SKIPS=notes, PYTHONHASHSEED="0",
             HETPIPE_BENCH_XLA_CACHE=os.path.join(tmp, "xla"), HOME=os.path.join(side, "home"),
             HETPIPE_JAX_CACHE=os.path.join(side, "profiles"))
  os.makedirs(env["HOME"], exist_ok=True)
  cmd = [sys.executable, "-P", "-m", "pytest", HERE, "-q", "--benchmark-quiet", f"--benchmark-json={out}"]
  if select:
    cmd += ["-k", select]
  with open(log, "w", encoding="utf-8") as f:
    try:
      rc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  results: dict = {"_skipped": {}, "_failed": {}}
  if os.path.exists(notes):
    with open(notes, encoding="utf-8") as f:
      for line in f:
        note = json.loads(line)
        results["_" + note["outcome"]][note["name"]] = note["reason"]
  if rc not in (0, 1, 5) or (rc == 1 and not results["_failed"]) or not os.path.exists(out):
    with open(log, encoding="utf-8") as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"the suite on {tree} ended with {rc}; the end of its output:\n{tail}")
  with open(out, encoding="utf-8") as f:
    for bench in json.load(f)["benchmarks"]:
      results[bench["name"]] = {**{s: bench["stats"][s] for s in STATS}, "extra_info": bench["extra_info"]}
  return results


def aggregate(runs: list[dict]) -> dict:
  """Per benchmark over the rounds: min of the minima, median of the medians, mean of the means."""
  names = sorted({n for r in runs for n in r if not n.startswith("_")})
  out = {}
  for name in names:
    got = [r[name] for r in runs if name in r]
    out[name] = {"min": min(g["min"] for g in got), "median": statistics.median(g["median"] for g in got),
                 "mean": statistics.fmean(g["mean"] for g in got), "rounds": len(got),
                 "extra_info": got[-1]["extra_info"]}
  for key in ("_skipped", "_failed"):
    out[key] = {n: reason for r in runs for n, reason in r[key].items()}
  return out


def with_derived(results: dict, stat: str) -> dict[str, tuple[float, str]]:
  """Each benchmark's value in seconds, and the derived figures (per task), as (value, unit)."""
  values = {n: (v[stat], "s") for n, v in results.items() if not n.startswith("_")}
  for name, (bench, base, per, scale, unit) in DERIVED.items():
    if bench in values and base in values and per in results[bench]["extra_info"]:
      values[name] = ((values[bench][0] - values[base][0]) / results[bench]["extra_info"][per] * scale, unit)
  return values


def show(value: float | None, unit: str) -> str:
  if value is None:
    return "-"
  if unit != "s":
    return f"{value:.1f} {unit}"
  return f"{value * 1e3:.1f} ms" if value < 10 else f"{value:.2f} s"


def report(ref_label: str, ref: dict | None, work: dict, stat: str, threshold: float,
           work_label: str = "working tree") -> int:
  """Prints one line per benchmark; returns how many ratios are above ``threshold``."""
  mine = with_derived(work, stat)
  theirs = with_derived(ref, stat) if ref is not None else {}
  names = [n for n in {**theirs, **mine} if n not in DERIVED] + [n for n in DERIVED if n in mine or n in theirs]
  width = max(len(n) for n in [*names, "benchmark"]) + 2
  print(f"{'benchmark':{width}}{ref_label:>18}{work_label:>18}{'ratio':>9}")
  slower = 0
  for name in names:
    a, b = theirs.get(name), mine.get(name)
    unit = (a or b or (0.0, "s"))[1]
    line = f"{name:{width}}{show(a and a[0], unit):>18}{show(b and b[0], unit):>18}"
    if a and b and a[0] > 0:
      ratio = b[0] / a[0]
      line += f"{ratio:9.2f}"
      if ratio > threshold:
        line, slower = line + f"  SLOWER (> {threshold:.2f})", slower + 1
      elif ratio < 1 / threshold:
        line += "  faster"
    print(line)
  for side, results in (("REF", ref), (work_label, work)):
    for key, what in (("_skipped", "skipped"), ("_failed", "FAILED")):
      for name, reason in (results or {}).get(key, {}).items():
        print(f"  {name}: {what} on {side}: {reason}")
  return slower


def save(path: str, root: str, results: dict, rounds: int) -> None:
  commit = git(root, "rev-parse", "HEAD")
  dirty = bool(git(root, "status", "--porcelain", "--untracked-files=no"))
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"version": 1, "commit": commit, "dirty": dirty, "rounds": rounds,
               "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
               "benchmarks": {n: v for n, v in results.items() if not n.startswith("_")}}, f, indent=1)
  print(f"saved the working tree's timings to {path}")


def make_parser() -> argparse.ArgumentParser:
  """The command line (module docstring)."""
  parser = argparse.ArgumentParser(prog="benchmarks/compare.sh", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("ref", nargs="?", help="git ref to compare against (default HEAD; none with --baseline)")
  parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (default 3)")
  parser.add_argument("--threshold", type=float, default=1.10, help="flag ratios above this (default 1.10)")
  parser.add_argument("--stat", choices=STATS, default="min", help="statistic over rounds (default min)")
  parser.add_argument("-k", dest="select", help="pytest -k expression: run only these benchmarks")
  parser.add_argument("--ref-tree", help="REF is already checked out here (no temporary worktree)")
  parser.add_argument("--work-tree", help="measure this checkout instead of the working tree (two commits)")
  parser.add_argument("--save", help="write the working tree's timings to this JSON file (a baseline)")
  parser.add_argument("--baseline", help="compare the working tree against this saved JSON instead of a ref")
  parser.add_argument("--timeout", type=float, default=900, help="seconds one suite run may take (default 900)")
  parser.add_argument("--fail", action="store_true", help="exit 1 when a ratio is above the threshold")
  parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, JSON per run)")
  return parser


def read_baseline(path: str) -> tuple[dict, str]:
  """(the timings, their label) of a saved baseline (:func:`save`), with a note on how far to trust them."""
  with open(path, encoding="utf-8") as f:
    base = json.load(f)
  print(f"note: the baseline was recorded {base['created']} on {base['machine']['node']}, not side by side: "
        "trust its ratios only on the same machine under the same load")
  label = f"baseline {base['commit'][:7]}{'+' if base.get('dirty') else ''}"
  return {**base["benchmarks"], "_skipped": {}, "_failed": {}}, label


def main(argv: list[str] | None = None) -> int:
  parser = make_parser()
  args = parser.parse_args(argv)
  if args.baseline and (args.ref or args.ref_tree):
    parser.error("give a ref or --baseline, not both")
  root = git(os.path.dirname(HERE), "rev-parse", "--show-toplevel")
  ref = args.ref or (None if args.baseline or args.save else "HEAD")
  tmp = tempfile.mkdtemp(prefix="hetpipe-bench-")
  ref_tree, worktree = args.ref_tree, None
  try:
    if ref is not None and ref_tree is None:
      sha = git(root, "rev-parse", "--verify", f"{ref}^{{commit}}")
      worktree = ref_tree = os.path.join(tmp, "ref")
      git(root, "worktree", "add", "--detach", "--quiet", worktree, sha)
    ref_label = f"{ref or 'REF'} ({git(ref_tree, 'rev-parse', '--short', 'HEAD')})" if ref_tree else "-"
    work_tree = os.path.abspath(args.work_tree) if args.work_tree else root
    sides = [("work", work_tree)] + ([("ref", os.path.abspath(ref_tree))] if ref_tree else [])
    runs: dict[str, list[dict]] = {"work": [], "ref": []}
    work_label = f"tree ({git(work_tree, 'rev-parse', '--short', 'HEAD')})" if args.work_tree else "working tree"
    what = f"{ref_label} ({ref_tree}) vs {work_label} ({work_tree})" if ref_tree else f"{work_label} ({work_tree}) only"
    print(f"benchmarks: {what}; {args.rounds} round(s){', sides alternating' if ref_tree else ''}; {args.stat} over "
          "rounds; CPU emulation", flush=True)
    for r in range(args.rounds):
      order = sides[::-1] if r % 2 == 0 else sides  # REF first in round 1
      for side, tree in order:
        t = time.perf_counter()
        runs[side].append(run_suite(tree, tmp, f"{side}{r}", args.select, args.timeout))
        print(f"  round {r + 1}: {'REF' if side == 'ref' else work_label} {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)
    work = aggregate(runs["work"])
    if args.save:
      save(args.save, root, work, args.rounds)
    theirs = aggregate(runs["ref"]) if ref_tree else None
    if args.baseline:
      theirs, ref_label = read_baseline(args.baseline)
    slower = report(ref_label, theirs, work, args.stat, args.threshold, work_label)
    failed = work["_failed"] or (theirs or {}).get("_failed")
    return 2 if failed else (1 if args.fail and slower else 0)
  except RuntimeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    if worktree is not None:
      subprocess.run(["git", "-C", root, "worktree", "remove", "--force", worktree], check=False)
    if args.keep:
      print(f"kept {tmp}", file=sys.stderr)
    else:
      shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
