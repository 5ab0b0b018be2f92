"""Timelines of a trace: Chrome/Perfetto trace-event JSON and a PNG Gantt chart.

Every device (virtual worker i, stage j) is a row; forward and backward tasks are boxes labelled with
their minibatch; time a virtual worker spent blocked at the WSP gate is a grey box on its own row.

CLI: ``python -m hetpipe_jax.timeline TRACE.jsonl [WAVES]`` writes ``TRACE.chrome.json`` (open it in
chrome://tracing or ui.perfetto.dev) and ``TRACE.gantt.png`` (the first WAVES waves, default 3) next to
the trace and prints their paths.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from hetpipe_jax.core import wsp
from hetpipe_jax.core.trace import trace_cli

COLOURS = {"fwd": "#4C72B0", "bwd": "#DD8452", "wait": "#BBBBBB"}


def chrome_trace(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
  """Trace-event JSON: complete events per task and gate wait, instant events for pushes and pulls."""
  events = list(events)
  meta = events[0]
  out = []
  for i, k in enumerate(meta["stages"]):
    out.append({"ph": "M", "name": "process_name", "pid": i, "args": {"name": f"virtual worker {i}"}})
    for j in range(k):
      out.append({"ph": "M", "name": "thread_name", "pid": i, "tid": j, "args": {"name": f"stage {j}"}})
    out.append({"ph": "M", "name": "thread_name", "pid": i, "tid": k, "args": {"name": "gate"}})
  us = lambda t: t * 1e6
  for ev in events[1:]:
    kind = ev["ev"]
    if kind in ("fwd", "bwd"):
      out.append({"ph": "X", "name": f"{'F' if kind == 'fwd' else 'B'}{ev['mb']}", "cat": kind,
                  "pid": ev["vw"], "tid": ev["stage"], "ts": us(ev["t0"]), "dur": us(ev["t1"] - ev["t0"]),
                  "args": {"own": ev["own"], **{k: ev[k] for k in ("glob", "seq") if k in ev}}})
    elif kind == "wait":
      out.append({"ph": "X", "name": "wait at gate", "cat": "wait", "pid": ev["vw"],
                  "tid": meta["stages"][ev["vw"]], "ts": us(ev["t0"]), "dur": us(ev["t1"] - ev["t0"])})
    elif kind in ("push", "pull"):
      name = (f"push wave {ev['wave']}" if kind == "push" else
              f"pull {ev['glob']}" if "glob" in ev else f"pull seq {ev['seq']}")  # (version 2: its seq)
      out.append({"ph": "i", "s": "p", "name": name, "cat": kind, "pid": ev["vw"], "ts": us(ev["t"])})
  return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"executor": meta.get("executor")}}


def plot_gantt(events: Iterable[dict[str, Any]], path: str, waves: int = 3) -> None:
  """A PNG Gantt chart of each virtual worker's first ``waves`` waves (drawn on a figure of its own, not
  through pyplot: a notebook's or a script's matplotlib backend stays as it is)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch

  events = list(events)
  meta = events[0]
  nms, stages = meta["nm"], meta["stages"]
  rows = [(i, j) for i, k in enumerate(stages) for j in list(range(k)) + ["gate"]]
  y = {row: n for n, row in enumerate(rows)}
  shown = [e for e in events[1:] if e["ev"] in ("fwd", "bwd") and wsp.wave_of(e["mb"], nms[e["vw"]]) < waves]
  t_end = max((e["t1"] for e in shown), default=1.0)
  waits = [e for e in events[1:] if e["ev"] == "wait" and e["t0"] < t_end]
  fig = Figure(figsize=(12, 0.45 * len(rows) + 1.2))
  ax = fig.subplots()
  for e in shown + waits:
    row = y[(e["vw"], e["stage"] if e["ev"] != "wait" else "gate")]
    t1 = min(e["t1"], t_end)
    ax.barh(row, t1 - e["t0"], left=e["t0"], height=0.8, color=COLOURS[e["ev"]], edgecolor="white", lw=0.5)
    if e["ev"] != "wait":
      ax.text(e["t0"] + (t1 - e["t0"]) / 2, row, str(e["mb"]), ha="center", va="center", fontsize=6,
              color="white")
  ax.set_yticks(range(len(rows)))
  ax.set_yticklabels([f"VW{i} {'stage ' + str(j) if j != 'gate' else 'gate'}" for i, j in rows], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlim(0, t_end)
  ax.set_xlabel(f"time (s, {meta.get('executor', '?')} clock)")
  handles = [Patch(color=c, label=kind) for kind, c in COLOURS.items()]
  ax.legend(handles=handles, loc="upper right", fontsize=7)
  ax.set_title(f"first {waves} waves: Nm={nms}, D={meta['d']}, {meta.get('weight_mode')}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
  """``python -m hetpipe_jax.timeline TRACE [WAVES]``: writes the Chrome trace and Gantt chart beside it."""
  return trace_cli(argv, "python -m hetpipe_jax.timeline TRACE.jsonl [WAVES]", 2, _export)


def _export(events: list[dict[str, Any]], argv: list[str]) -> int:
  waves = argv[2] if len(argv) == 3 else "3"
  if not waves.isdigit() or int(waves) < 1:
    print(f"error: WAVES={waves!r}; give how many waves to draw, a whole number >= 1", file=sys.stderr)
    return 2
  base = os.path.splitext(argv[1])[0]
  with open(base + ".chrome.json", "w", encoding="utf-8") as f:
    json.dump(chrome_trace(events), f)
  plot_gantt(events, base + ".gantt.png", int(waves))
  print(f"chrome   {os.path.abspath(base + '.chrome.json')}")
  print(f"gantt    {os.path.abspath(base + '.gantt.png')}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
