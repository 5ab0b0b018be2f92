"""Pictures of runs: timelines (Chrome/Perfetto JSON, Gantt PNG)."""
