"""The inference engine: memory pools, scheduler, model runner, sampler."""

from .engine import Engine
from .request import StepOutput
from .sampling_params import SamplingParams
from .scheduler import RequestRefused

__all__ = ["Engine", "StepOutput", "SamplingParams", "RequestRefused"]
