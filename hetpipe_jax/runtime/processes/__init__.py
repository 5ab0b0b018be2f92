"""The multi-process runtime of the ``multiprocess`` executor: one process per node, a decentralised run
(docs/PROTOCOL.md sections 11.5, 11.6):

* :mod:`~hetpipe_jax.runtime.processes.build`: what every process builds its part from (``Job``), where every stage
  runs (``process_of``) and one stage compiled on its local devices (``build_stage``);
* :mod:`~hetpipe_jax.runtime.processes.decentral`: the decentralised run's design, and what the threads of one
  process share (``Context``, ``Actor``);
* :mod:`~hetpipe_jax.runtime.processes.job`: one process's part of a run (``DecentralJob``);
* :mod:`~hetpipe_jax.runtime.processes.clock`: the WSP clock service (in process 0);
* :mod:`~hetpipe_jax.runtime.processes.stage_loop`: one stage's loop, by the schedule where it runs;
* :mod:`~hetpipe_jax.runtime.processes.shards`: the PS shards' copies, primary and backup (``ShardFollower``).

Arrays and control move through :mod:`hetpipe_jax.runtime.transport`. Checkpointed, ``--rejoin`` and live-adapting
runs go in parts, each a decentralised run of its own (:mod:`hetpipe_jax.run.executors.parts`).
"""
