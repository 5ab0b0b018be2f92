"""The pure core: the WSP clock and bounds, pipeline schedules, weight versions, the engine that drives
them, the transport and server protocols, the trace format and its checker. Imports nothing of the
package above it (no devices, no cluster, no cost model)."""
