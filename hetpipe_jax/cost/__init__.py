"""Costs of units and stages (HETPIPE.md section 4): ``profile`` (per-unit flops, bytes, activations,
cached), ``roofline`` (time of a unit on a GPU type), ``memory`` (a stage's memory), ``transfer`` (boundary
transfers and a stage's time). Nothing here imports the planner, the runtime or the simulator."""
