"""The multi-process runtime of the ``multiprocess`` executor: one process per node.

The decentralised runtime, every run without checkpoints or ``--fail`` (docs/PROTOCOL.md sections 11.9, 11.10):

* :mod:`~hetpipe_jax.runtime.processes.decentral`: the decentralised run's design, and what the threads of one
  process share (``Context``, ``Actor``);
* :mod:`~hetpipe_jax.runtime.processes.job`: one process's part of a decentralised run (``DecentralJob``);
* :mod:`~hetpipe_jax.runtime.processes.clock`: the WSP clock service (in process 0);
* :mod:`~hetpipe_jax.runtime.processes.stage_loop`: one stage's loop, by the schedule where it runs;
* :mod:`~hetpipe_jax.runtime.processes.shards`: the PS shards' copies, primary and backup (``ShardFollower``), and
  the central runtime's shard threads and sharded server.

The central runtime, that checkpointed and ``--fail`` runs still take (one engine in process 0):

* :mod:`~hetpipe_jax.runtime.processes.node_job`: one process's part of a central run (``NodeJob``);
* :mod:`~hetpipe_jax.runtime.processes.remote`: process 0's numerics adapter and the merged trace;
* :mod:`~hetpipe_jax.runtime.processes.stage_worker`: a stage's thread;
* :mod:`~hetpipe_jax.runtime.processes.channels`: command channels (post, execute in order, report, wait).

Arrays and control move through :mod:`hetpipe_jax.runtime.transport`.

The central runtime: one process per node, one engine.

Process i holds node i's GPUs (emulated by its CPU devices) and runs the stages placed on them: one
thread per local stage executes that stage's commands in order (a forward, a backward, closing a wave,
a rebase), jitted per device as in one process. Activations and gradients go straight from the process of
one stage to the process of the next through the transport (:mod:`hetpipe_jax.runtime.transport.node`);
inside a process they stay local.

Process 0 is also the controller: it runs the single-process :class:`~hetpipe_jax.core.engine.Engine` (the
schedule, the WSP clock, gate, push and pull, the trace: not a second copy) on the ``wall`` executor, whose
device threads wait for each task's process to report it done. Its numerics adapter,
:class:`~hetpipe_jax.runtime.processes.remote.RemoteNumerics`, turns "start this task" into a command for the
stage's process, and its server, :class:`~hetpipe_jax.runtime.processes.shards.ShardedServer`, keeps the WSP
clocks while the weights live in the processes that own their PS shards
(:class:`~hetpipe_jax.runtime.processes.shards.ShardWorker`, host CPU, placed by ``--placement``). Closing a
wave sends each stage's summed update straight to the owners of its units' shards, which apply it; a pull has
the owners send each stage its units' global weights, and the stage adds its open accumulators back. Control
goes through the coordination service's key-value store (``cmd/<channel>/<seq>``, reports under
``done/<channel>/<seq>``); each channel (a stage, a process's shards) executes its commands in the order
posted, which is what orders pushes, pulls and tasks: pushes and pulls are posted without waiting.

The trace: every process records its own tasks (which process ran it, and ``busy``: how long it worked on it,
on that process's clock) and reports them; the engine writes every event in the order it happened there, which
is causal by construction (a task is started only after the reports it depends on arrived; a push is posted
before any pull that sees it, and its owners apply it before they serve that pull; a gate opens before the
injection it allows). At the end, :func:`~hetpipe_jax.runtime.processes.remote.merge_records` joins each task
event with its process's record by identity, never by timestamps: the clocks of different hosts are not
compared. Event times are process 0's wall clock.
"""
