"""Costs of units and stages (docs/PROTOCOL.md section 4): ``unit`` (``UnitProfile``, the data every other module
reads), ``profile`` (per-unit flops, bytes, activations, cached), ``roofline`` (time of a unit on a GPU type),
``memory`` (a stage's memory), ``transfer`` (boundary transfers and a stage's time). Nothing here imports the
planner, the runtime or the simulator."""
