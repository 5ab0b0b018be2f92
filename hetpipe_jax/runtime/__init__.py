"""The runtime on JAX devices, in three subpackages by concept:

* :mod:`hetpipe_jax.runtime.numerics`: the numerics of one process (stages, a virtual worker's pipeline, the
  parameter server with weights, mixed precision, per-wave metrics, checkpoints, the in-process transport, and
  the ``virtual`` and ``wall`` executors' loops), what every process of a ``multiprocess`` run computes too;
* :mod:`hetpipe_jax.runtime.transport`: moving arrays and control between processes (``Node`` on JAX's
  distributed APIs, mailboxes, the protocol as data, launching a job's processes);
* :mod:`hetpipe_jax.runtime.processes`: the multi-process runtime of the ``multiprocess`` executor, one process
  per node, decentralised (no process commands the others).

The ``sim`` executor, without numerics, is :mod:`hetpipe_jax.sim`."""
