"""The run layer: a :class:`~hetpipe_jax.run.config.RunConfig` becomes a run.

``config`` (what to run, in validated parts) -> ``setup`` (profiles, layouts, the one builder) ->
``executors`` (a registry: each executor a module) -> ``session`` (trace, checkpoints, metrics and
evaluation around the engine) -> ``result``. :func:`hetpipe_jax.api.run_hetpipe` is that pipeline.
"""
