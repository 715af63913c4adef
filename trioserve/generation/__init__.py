"""One generation, from a request to its outcome, whichever door it came in
by: :class:`~.generation.Generation` (admission, prompt, trimming, tokens,
timing, interrupt), the :class:`~.scheduler.Scheduler` (the generation task:
fairness and routing), and the :class:`~.engine_thread.EngineThread` that runs
every torch call. Knows trio and the Engine protocol; no sockets, no wire
format."""

from .choices import follow_choices, start_choices
from .engine_thread import EngineThread, EngineThreadClosed, open_engine_thread
from .generation import (
    Fit,
    Generation,
    GenerationObserver,
    GenerationRequest,
    Generations,
    InvalidGeneration,
    Overloaded,
    Tokenizing,
    admit_client,
)
from .scheduler import Job, QueueFull, Scheduler, SchedulerClosed, SchedulerStatistics, StepRecord

__all__ = [
    "EngineThread",
    "EngineThreadClosed",
    "Fit",
    "Generation",
    "GenerationObserver",
    "GenerationRequest",
    "Generations",
    "InvalidGeneration",
    "Job",
    "Overloaded",
    "QueueFull",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStatistics",
    "StepRecord",
    "Tokenizing",
    "admit_client",
    "follow_choices",
    "open_engine_thread",
    "start_choices",
]
