"""The runtime on JAX devices: stages, the virtual workers' numerics, the parameter server with weights,
the in-process transport, per-wave metrics, and the ``virtual`` and ``wall`` executors."""
