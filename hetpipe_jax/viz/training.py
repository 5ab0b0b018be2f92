"""A run's training curves: train loss per virtual worker, and the global weights' test accuracy (a language
model's test perplexity, with its unigram baseline) against time on the executor's clock.

Drawn on a figure of its own, not through pyplot (a notebook's or a script's matplotlib backend stays as it is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from hetpipe_jax.evaluate import LanguageScore


def plot_training(metrics: Sequence[dict[str, Any]], path: str, title: str,
                  language: LanguageScore | None = None) -> str:
  """Writes the PNG of a run's metrics rows (``vw``, ``time``, ``train_loss``; ``test_accuracy`` and
  ``test_loss`` at evaluations) to ``path``; returns ``path``.

  Args:
    metrics: the run's metrics rows.
    path: the PNG to write.
    title: the figure's title.
    language: a language model's score: the right panel is then the test perplexity (``exp`` of the test loss
      per token) with the unigram baseline as a line, not the accuracy.
  """
  fig = Figure(figsize=(11, 4))
  ax_loss, ax_test = fig.subplots(1, 2)
  for vw in sorted({r["vw"] for r in metrics}):
    rows = [r for r in metrics if r["vw"] == vw]
    ax_loss.plot([r["time"] for r in rows], [r["train_loss"] for r in rows], label=f"VW {vw}", lw=1)
  if language is None:
    evals = [r for r in metrics if "test_accuracy" in r]
    ax_test.plot([r["time"] for r in evals], [r["test_accuracy"] for r in evals], "o-", color="k")
    labels = ("train loss (per wave)", "test accuracy (global weights)")
  else:
    _perplexity_panel(ax_test, metrics, language)
    per = language.unit[:-1]  # "byte" or "token"
    labels = (f"train loss (nats per {per}, per wave)", f"test perplexity per {per} (global weights)")
  for ax, label in zip((ax_loss, ax_test), labels):
    ax.set_xlabel("time (s, executor clock)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_loss.legend()
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def _perplexity_panel(ax, metrics: Sequence[dict[str, Any]], language: LanguageScore) -> None:
  """The test perplexity of the global weights at each evaluation, and the unigram baseline's as a line."""
  evals = [r for r in metrics if "test_loss" in r]
  ax.plot([r["time"] for r in evals], [math.exp(r["test_loss"]) for r in evals], "o-", color="k",
          label="global weights")
  if language.unigram_perplexity is not None:
    ax.axhline(language.unigram_perplexity, color="tab:red", ls="--",
               label=f"unigram baseline ({language.unigram_perplexity:.3g})")
  ax.legend()
