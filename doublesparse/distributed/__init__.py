"""Tensor parallelism over torch.distributed (docs/parallelism.md).

:mod:`.shard` (who holds which heads, widths and vocabulary rows), :mod:`.layers` (the parallel
layers and ``parallelize``), :mod:`.loading` (a rank's part of a model), :mod:`.group` (the
processes and process groups), :mod:`.steps` (rank 0's steps sent to the others),
:mod:`.worker` (the other ranks' loop), :mod:`.rank` (what engine setup asks of a rank).
Nothing here is imported with ``--tp-size 1``.
"""
