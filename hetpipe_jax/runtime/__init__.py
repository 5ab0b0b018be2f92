"""The runtime on JAX devices: stages, the virtual workers' numerics, the parameter server with weights,
the in-process transport, per-wave metrics, checkpoints, the ``virtual`` and ``wall`` executors, and the
``multiprocess`` executor (``distributed``, ``launch`` and ``multiprocess``: one process per node). The
``sim`` executor, without numerics, is :mod:`hetpipe_jax.sim`."""
