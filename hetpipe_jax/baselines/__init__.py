"""The peers of HetPipe, on the same cost model, catalogue, links and shared-flow network as its ``sim``
executor (:mod:`~hetpipe_jax.baselines.systems` lists them), and their numerics for the convergence study.

Timing: ``horovod`` (equal batches, fused all-reduce), ``hetero_dp`` (batches in proportion to speed),
``sync_pipeline`` (the planner's pipelines, synchronous, 1F1B with a flush), ``local_sgd`` (DiLoCo), all on
:mod:`~hetpipe_jax.baselines.sync`. Numerics: :mod:`~hetpipe_jax.baselines.numerics` (weighted synchronous
SGD, local SGD with an outer optimizer) and :mod:`~hetpipe_jax.baselines.data_parallel` (equal batches).
"""
