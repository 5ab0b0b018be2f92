"""Baselines: Horovod-style synchronous data parallelism, as a cost model (``horovod``) and numerically
(``data_parallel``)."""
