"""``doublesparse.Engine``: the engine with what it asks of the layers above it handed in.

The engine (:mod:`doublesparse.engine`) stands below calibration and tensor parallelism, which
both build and run it, so it imports neither: whoever builds an engine passes it an on-demand
calibration (``--ds-channel-config-path auto``) and a starter of tensor-parallel ranks
(``--tp-size`` > 1). This is that builder for the Python API and the commands (``serve``,
``generate``, the benchmarks). Both are imported when first used, so ``--tp-size 1`` imports
nothing of :mod:`doublesparse.distributed`.
"""

from __future__ import annotations

from pathlib import Path

from .engine import engine


def calibrate_on_demand(model, tokenizer, model_file: str | None, progress: bool = True) -> Path:
    """:class:`~doublesparse.engine.setup.OnDemandCalibration`: the cached calibrated config of
    ``model``, calibrating it the first time (:func:`doublesparse.calibrate.on_demand.ensure_config`)."""
    from .calibrate.on_demand import ensure_config
    return ensure_config(model, tokenizer, model_file, progress=progress)


def start_ranks(cfg, model=None, group=None):
    """:class:`~doublesparse.engine.engine.StartRanks`: rank 0 of ``cfg.tp_size`` ranks
    (:func:`doublesparse.distributed.group.start`)."""
    from .distributed.group import start
    return start(cfg, model, group)


class Engine(engine.Engine):
    """:class:`doublesparse.engine.Engine` built with :func:`calibrate_on_demand` and
    :func:`start_ranks` (either may still be passed in to replace them)."""

    def __init__(self, config=None, *, start_ranks=start_ranks, calibrate=calibrate_on_demand, **kwargs):
        super().__init__(config, start_ranks=start_ranks, calibrate=calibrate, **kwargs)
