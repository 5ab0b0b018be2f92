"""The peers of HetPipe, on the same cost model, catalogue, links and shared-flow network as its ``sim``
executor, and their numerics for the convergence study; each is a system of :mod:`hetpipe_jax.systems` (which
lists them and says how they are simulated, trained, tuned and described).

Timing: ``horovod`` (equal batches, fused all-reduce), ``hetero_dp`` (batches in proportion to speed),
``sync_pipeline`` (the planner's pipelines, synchronous, 1F1B with a flush), ``local_sgd`` (DiLoCo), all on
:mod:`~hetpipe_jax.baselines.sync`. Numerics: :mod:`~hetpipe_jax.baselines.numerics` (one trainer: weighted
synchronous SGD, local SGD with an outer optimizer) and :mod:`~hetpipe_jax.baselines.data_parallel` (equal batches).
"""
