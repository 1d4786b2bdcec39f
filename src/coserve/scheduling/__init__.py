"""Pure scheduling policy of the coserve engine: TDG gain, SlideBatching, cost model, preemption.

Imports the stdlib and numpy only; ``coserve.engine`` adapts vLLM to it.
"""

from coserve.scheduling.cost_model import CostSample, FitReport, StepCostModel, fit_cost_model
from coserve.scheduling.gain import GainReport, request_gain, slo_attained
from coserve.scheduling.preemption import PreemptionDecision, RunningStep, should_preempt
from coserve.scheduling.requests import ClassRegistry, InvalidRequestClass, RequestClass, SchedRequest
from coserve.scheduling.slide_batching import SlideBatching, SlideConfig, StepDecision

__all__ = [
    "ClassRegistry",
    "CostSample",
    "FitReport",
    "GainReport",
    "InvalidRequestClass",
    "PreemptionDecision",
    "RequestClass",
    "RunningStep",
    "SchedRequest",
    "SlideBatching",
    "SlideConfig",
    "StepCostModel",
    "StepDecision",
    "fit_cost_model",
    "request_gain",
    "should_preempt",
    "slo_attained",
]
