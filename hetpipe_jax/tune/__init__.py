"""The auto-tuner: the fastest configuration of a model on a cluster, searched with the planner and the
``sim`` executor (issue 11).

A configuration is a grouping of the cluster's GPUs into virtual workers, each virtual worker's GPU order,
cuts and Nm, the clock distance bound D, the PS shard placement, whether stage-to-stage transfers
overlap computation, and whether each stage's part of a push and a pull moves on its own (staged PS
transfers). The search (:func:`tune`, :mod:`~hetpipe_jax.tune.search`), in three rounds:

1. **Plan** every grouping (:mod:`~hetpipe_jax.tune.groupings`): NP, ED, HD, and general ones (ED with m
   GPUs of every type per virtual worker, every node split into s virtual workers, HD's node pairs split
   into p virtual workers). Each virtual worker is partitioned (exactly, :mod:`hetpipe_jax.plan.partition`)
   at every Nm that fits its memory; alike virtual workers share one partition
   (:mod:`~hetpipe_jax.tune.planner`). Nm per virtual worker is then chosen three ways: the same Nm for
   all, the planner's ``max_fit``, and *sized to speed* (a faster virtual worker does more minibatches per
   wave, so that the waves of all take about as long: under WSP the long-run wave rate of every virtual
   worker is the slowest one's). Each choice gets the WSP-aware modelled rate:
   ``batch x sum_i Nm_i x min_i (T_i / Nm_i)`` for T_i the virtual worker's modelled minibatches/s.
2. **Screen** the best modelled choices (and the best two of every grouping; when staleness matters, a
   few more of every grouping spread over its range of wave sizes) on the simulator at D = 0, on short
   runs: a grouping's best modelled choice in every placement and transfer model, its other choices in the
   two settings that served that one best.
3. **Refine** the fastest few at every D, on runs of full length, and run the fixed policies (NP, ED, HD at
   the planner's max_fit Nm) in every setting too, so that the tuned configuration is at least as fast as
   each of them. The best is the prediction.

Every simulated run's trace passes the WSP checker (:mod:`~hetpipe_jax.tune.pool`, which runs them on a
process pool). Cost: O(groupings x Nm) partitions plus a few dozen short simulations; the paper testbed
takes seconds. What the search tries and how: :mod:`~hetpipe_jax.tune.options`; what it returns, and
``tune.json``: :mod:`~hetpipe_jax.tune.result`. Ranking by time to accuracy uses the convergence study's
staleness model (:mod:`hetpipe_jax.staleness`, re-exported here).

Beside HetPipe the search tries the peers of ``SearchSpace.peers`` (:mod:`hetpipe_jax.baselines`), each over a
small grid of its knobs (:mod:`~hetpipe_jax.tune.peers`), ranked by the same objective: images/s, or the
predicted time to accuracy, a peer's images to target from the convergence study's runs of its kind
(:mod:`~hetpipe_jax.tune.statistical`: the critical batch size for the synchronous peers, H for local SGD).
``TuneResult.overall`` is the best of every system, ``TuneResult.best`` HetPipe's.
"""

from hetpipe_jax.staleness import StalenessModel, fit_staleness_model, mean_staleness
from hetpipe_jax.tune.candidate import Candidate, modelled_images_per_sec
from hetpipe_jax.tune.groupings import groupings
from hetpipe_jax.tune.options import RunSetting, SearchSpace, TuneOptions
from hetpipe_jax.tune.peers import (
  HETPIPE,
  PeerResult,
  PeerSkip,
  peer_grid,
  peer_json,
  peer_knobs,
  search_peers,
  system_of,
  tuner_profiles,
)
from hetpipe_jax.tune.planner import Planner, nm_choices, replicate
from hetpipe_jax.tune.pool import SimContext, Simulations, simulate_candidate
from hetpipe_jax.tune.result import (
  Result,
  Row,
  TuneResult,
  candidate_json,
  distinct_rows,
  pareto_front,
  peer_result_json,
  policy_rows,
  result_json,
)
from hetpipe_jax.tune.search import spread, tune
from hetpipe_jax.tune.statistical import (
  CriticalBatch,
  LocalStepsFit,
  PeerAccuracyModel,
  fit_critical_batch,
  fit_local_steps,
  fit_peer_accuracy,
)

__all__ = [
    "HETPIPE", "Candidate", "CriticalBatch", "LocalStepsFit", "PeerAccuracyModel", "PeerResult", "PeerSkip",
    "Planner", "Result", "Row", "RunSetting", "SearchSpace", "SimContext", "Simulations", "StalenessModel",
    "TuneOptions", "TuneResult", "candidate_json", "distinct_rows", "fit_critical_batch", "fit_local_steps",
    "fit_peer_accuracy", "fit_staleness_model", "groupings", "mean_staleness", "modelled_images_per_sec",
    "nm_choices", "pareto_front", "peer_grid", "peer_json", "peer_knobs", "peer_result_json", "policy_rows",
    "replicate", "result_json", "search_peers", "simulate_candidate", "spread", "system_of", "tune",
    "tuner_profiles",
]
