"""Moving arrays and control between the processes of a ``multiprocess`` run.

* :mod:`~hetpipe_jax.runtime.transport.node`: ``Node``, the one module on JAX's distributed APIs (coordination
  service, ``jax.experimental.transfer``);
* :mod:`~hetpipe_jax.runtime.transport.mailbox`: arrays between threads and processes, checkpoint trees, timeouts;
* :mod:`~hetpipe_jax.runtime.transport.protocol`: every command and message kind, as data, shared by both ends;
* :mod:`~hetpipe_jax.runtime.transport.launch`: starts a job's processes on this host, watches them, ends them all on
  a failure.
"""
