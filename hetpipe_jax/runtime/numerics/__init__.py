"""The numerics of one process: what the ``virtual`` and ``wall`` executors compute, and what every process of a
``multiprocess`` run computes for its own stages and PS shards.

* :mod:`~hetpipe_jax.runtime.numerics.stage`: one pipeline stage on one device: jitted forward, backward, local update;
* :mod:`~hetpipe_jax.runtime.numerics.pipeline`: one virtual worker's stages and the tensors between them;
* :mod:`~hetpipe_jax.runtime.numerics.ps`: the parameter server: global weights sharded by unit, optax apply on push;
* :mod:`~hetpipe_jax.runtime.numerics.metrics`: per-wave metrics and the global weights to evaluate;
* :mod:`~hetpipe_jax.runtime.numerics.mixed`: mixed precision: 16-bit casts, fp16 loss scale, the finiteness check;
* :mod:`~hetpipe_jax.runtime.numerics.checkpoint`: orbax checkpoints of a run: the cut, what it holds, restore;
* :mod:`~hetpipe_jax.runtime.numerics.loops`: the ``virtual`` and ``wall`` executors' loops (``run_virtual``,
  ``run_wall``);
* :mod:`~hetpipe_jax.runtime.numerics.device_comm`: ``DeviceComm``, the in-process transport (``jax.device_put``).
"""
