"""Planning a run (docs/PROTOCOL.md sections 4-5): ``layout`` (the run's shape), ``vw_plan`` (a virtual worker's
stages, times and memory), ``partition`` (the DP over cuts and GPU orders), ``allocation`` (virtual
workers of a cluster), ``placement`` (PS shards), ``plan_json``, ``costmodel`` (task times and the memory
check of a layout). Nothing here imports the runtime or the simulator."""
