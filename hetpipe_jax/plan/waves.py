"""Waves sized to each virtual worker's speed: Nm policy ``speed`` (DyLU for WSP).

Under WSP every virtual worker's long-run wave rate is the slowest one's, so a faster virtual worker that
runs the same Nm waits at the gate. Async Local-SGD's DyLU (Liu et al., "Asynchronous Local-SGD Training for
Language Modeling", arXiv 2401.09135) gives each worker local steps in proportion to its speed;
here a virtual worker's wave is its local steps, so the waves are sized so that they all last about as long.

A virtual worker's *wave time* at Nm is ``Nm / throughput`` seconds, its modelled minibatches per second
(:attr:`hetpipe_jax.plan.vw_plan.VWPlan.throughput`: the slowest stage, or what is in flight over one round
trip). Nm policy ``speed``, exactly (:func:`speed_sized`):

1. every virtual worker's ``max_fit`` Nm ``M_i``: the largest Nm <= ``nm_max`` whose partition fits its
   memory (``nm_max``: the largest Nm tried, default its GPU count);
2. the target wave time ``T = max_i M_i / throughput_i(M_i)``: the longest of those waves (the slowest
   virtual worker's, when the ``M_i`` agree);
3. every virtual worker gets the most minibatches ``Nm_i`` whose wave lasts at most ``T`` (relative tolerance
   1e-9): at ``Nm_i <= M_i`` its partition at ``Nm_i``; beyond ``M_i`` its partition at ``M_i`` with a window
   of ``M_i`` minibatches in flight (:mod:`hetpipe_jax.plan.layout`), so that memory holds it and the wave
   time is ``Nm_i / throughput_i(M_i)``.

So no virtual worker runs fewer minibatches in flight than its ``max_fit``, the one that sets ``T`` runs its
``max_fit`` Nm, and every wave lasts between ``T`` less one minibatch's time and ``T``. Example: two
single-stage virtual workers of 2 and 1 minibatches per second that hold 2 and 4 minibatches: ``T = 4 / 1 =
4`` s, so the fast one runs waves of 8 minibatches, 2 in flight, and the slow one waves of 4.

The tuner (:func:`hetpipe_jax.tune.nm_choices`) offers the same sizing at every wave time of its plans, with
:func:`windowed` and :func:`sized_to`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hetpipe_jax.plan.vw_plan import VWPlan

TOLERANCE = 1e-9  # a wave counts as lasting at most T when it is no longer than T (1 + TOLERANCE)


def wave_seconds(plan: VWPlan) -> float:
  """A virtual worker's modelled seconds per wave: Nm over its modelled minibatches per second."""
  return plan.nm / plan.throughput


def windowed(plans: Mapping[int, VWPlan], wave_max: int) -> dict[int, VWPlan]:
  """``plans`` (Nm -> plan, every Nm that fits) with waves of up to ``wave_max`` minibatches beyond the
  largest Nm that fits, each the plan of that Nm with it as the window."""
  top = plans[max(plans)]
  return {**{n: top.with_wave(n) for n in range(max(plans) + 1, wave_max + 1)}, **plans}


def sized_to(per_vw: Sequence[Mapping[int, VWPlan]], seconds: float) -> list[VWPlan] | None:
  """Every virtual worker's plan with the most minibatches whose wave lasts at most ``seconds``.

  Args:
    per_vw: per virtual worker, Nm -> its plan at that Nm (windowed or not).
    seconds: the wave time.

  Returns:
    A plan per virtual worker, or None when one has no wave that short.
  """
  nms = [max((n for n, p in plans.items() if n / p.throughput <= seconds * (1 + TOLERANCE)), default=0)
         for plans in per_vw]
  return [plans[n] for plans, n in zip(per_vw, nms)] if all(nms) else None


def speed_sized(per_vw: Sequence[Mapping[int, VWPlan]]) -> list[VWPlan]:
  """Nm policy ``speed`` (the module docstring): waves of about the same time for every virtual worker.

  Args:
    per_vw: per virtual worker, Nm -> its plan at that Nm, for every Nm up to its ``max_fit`` (the largest).

  Returns:
    A plan per virtual worker: the most minibatches whose wave lasts at most the longest wave at ``max_fit``;
    beyond ``max_fit`` with a window of ``max_fit``.
  """
  target = max(wave_seconds(plans[max(plans)]) for plans in per_vw)
  # beyond max_fit the throughput stays that of max_fit: the longest wave within the target is below `reach`
  reach = [int(target * (1 + TOLERANCE) * plans[max(plans)].throughput) + 1 for plans in per_vw]
  sized = sized_to([windowed(plans, n) for plans, n in zip(per_vw, reach)], target)
  assert sized is not None  # every max_fit wave lasts at most the target
  return sized
