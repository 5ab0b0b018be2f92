"""The ``multiprocess`` executor: one process per node, one engine.

Process i holds node i's GPUs (emulated by its CPU devices) and runs the stages placed on them: one
thread per local stage executes that stage's commands in order (a forward, a backward, closing a wave,
a rebase), jitted per device as in one process. Activations and gradients go straight from the process of
one stage to the process of the next through the transport (:mod:`hetpipe_jax.runtime.distributed`);
inside a process they stay local.

Process 0 is also the controller: it runs the single-process :class:`~hetpipe_jax.core.engine.Engine`
(the schedule, the WSP clock, gate, push and pull, the trace: not a second copy) on the ``wall``
executor, whose device threads wait for each task's process to report it done. Its numerics adapter,
:class:`RemoteNumerics`, turns "start this task" into a command for the stage's process, and its server,
:class:`ShardedServer`, keeps the WSP clocks while the weights live in the processes that own their PS
shards (:class:`ShardWorker`, host CPU, placed by ``--placement``). Closing a wave sends each stage's
summed update straight to the owners of its units' shards, which apply it; a pull has the owners send
each stage its units' global weights, and the stage adds its open accumulators back. Control goes
through the coordination service's key-value store (``cmd/<channel>/<seq>``, reports under
``done/<channel>/<seq>``); each channel (a stage, a process's shards) executes its commands in the order
posted, which is what orders pushes, pulls and tasks: pushes and pulls are posted without waiting.

The trace: every process records its own tasks (which process ran it, and ``busy``: how long it worked
on it, on that process's clock) and reports them; the engine writes every event in the order it happened
there, which is causal by construction (a task is started only after the reports it depends on arrived;
a push is posted before any pull that sees it, and its owners apply it before they serve that pull; a
gate opens before the injection it allows). At the end, :func:`merge_records` joins each task event with
its process's record by identity, never by timestamps: the clocks of different hosts are not compared.
Event times are process 0's wall clock.


One concept per module:

* :mod:`hetpipe_jax.runtime.protocol`: every command and message kind, as data, shared by both ends;
* :mod:`hetpipe_jax.runtime.mailbox`: arrays between threads and processes, checkpoint trees, timeouts;
* :mod:`hetpipe_jax.runtime.channels`: command channels (post, execute in order, report, wait);
* :mod:`hetpipe_jax.runtime.stage_worker`: a stage's thread;
* :mod:`hetpipe_jax.runtime.shards`: the PS shards' thread and process 0's sharded server;
* :mod:`hetpipe_jax.runtime.remote`: process 0's numerics adapter and the merged trace;
* :mod:`hetpipe_jax.runtime.node_job`: one process's part of the job.
"""

from hetpipe_jax.runtime.channels import Channel, Pending, command_loop, wait
from hetpipe_jax.runtime.mailbox import IDLE_S, TIMEOUT_S, JobStopped, Mailbox
from hetpipe_jax.runtime.remote import RemoteNumerics, merge_records, process_of
from hetpipe_jax.runtime.shards import ShardedServer, ShardWorker
from hetpipe_jax.runtime.stage_worker import StageWorker

__all__ = ["IDLE_S", "TIMEOUT_S", "Channel", "JobStopped", "Mailbox", "Pending", "RemoteNumerics", "ShardWorker",
           "ShardedServer", "StageWorker", "command_loop", "merge_records", "process_of", "wait"]
