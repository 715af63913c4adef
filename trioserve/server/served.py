"""One loaded model as the doors use it: its engine, scheduler, tokenizer,
chat template and :class:`~trioserve.generation.Generations`, and what the
``info`` reply and ``/v1/models`` say of it.

A server holds one per loaded model (:mod:`trioserve.server.models`); the
model's scheduler runs as a task of the model's own scope, so that unloading
one model stops its step loop and nothing else.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from trioserve import protocol as p
from trioserve.chat_template import ChatTemplate, NoChatTemplate, load_chat_template
from trioserve.engine.base import Engine, EngineInfo, grammars_of
from trioserve.errors import ConfigError, TrioserveError
from trioserve.generation import Generations, Tokenizing
from trioserve.generation.engine_thread import EngineThread
from trioserve.generation.scheduler import Scheduler, StepRecord
from trioserve.vocabulary.reasoning import KNOWN_MARKERS, ReasoningFormat, reasoning_format

if TYPE_CHECKING:
    from trioserve.metrics import Metrics

__all__ = ["ModelSettings", "ServedModel", "load_template", "model_template"]

log = logging.getLogger("trioserve.server")


@attrs.frozen(kw_only=True)
class ModelSettings:
    """The server's settings that shape each model's pipeline
    (:class:`~trioserve.server.ServerConfig`'s, by the same names)."""

    max_new_tokens: int | None = None
    max_waiting_jobs: int = 256
    max_running_per_client: int | None = None
    max_requests_per_client: int = 64
    tool_call_format: str = "auto"
    reasoning_format: str = "auto"
    reasoning_budget: int | None = None
    chat_template: str | None = None


@attrs.define(eq=False)
class ServedModel:
    """A loaded model's pipeline (:meth:`build` makes one)."""

    #: The name requests give it: its id in a models folder, else the model's name.
    id: str
    engine: Engine
    scheduler: Scheduler
    tokenizing: Tokenizing
    generations: Generations
    chat_template: ChatTemplate | None
    #: The server's cap on generated tokens for it (at most its context - 1).
    max_new_tokens: int
    #: Set while it unloads: new requests for it are refused, naming it.
    unloading: bool = False

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @classmethod
    def build(
        cls,
        model_id: str,
        engine: Engine,
        settings: ModelSettings,
        *,
        engine_thread: EngineThread | None = None,
        metrics: Metrics | None = None,
        is_draining: Callable[[], bool] = lambda: False,
        in_flight: collections.Counter[Hashable] | None = None,
        chat_template: ChatTemplate | str | None = "auto",
    ) -> ServedModel:
        """The pipeline of ``engine`` under ``model_id``. ``in_flight``: the
        per-client count of generations, shared by every model of a server
        (``--max-requests-per-client`` holds across them); ``chat_template``:
        ``auto`` loads the model's own (or ``settings.chat_template``'s)."""
        info = engine.info
        max_new_tokens = min(
            settings.max_new_tokens or info.context_length, info.context_length - 1
        )
        scheduler = Scheduler(
            engine,
            max_waiting=settings.max_waiting_jobs,
            max_running_per_owner=settings.max_running_per_client,
        )
        scheduler.engine_thread = engine_thread
        tokenizing = Tokenizing(engine)
        template = (
            load_template(info, settings.chat_template)
            if isinstance(chat_template, str)
            else chat_template
        )
        served: ServedModel

        def draining() -> bool:
            return is_draining() or served.unloading

        generations = Generations(
            scheduler=scheduler,
            tokenizing=tokenizing,
            max_new_tokens=max_new_tokens,
            chat_template=template,
            observer=metrics,
            is_draining=draining,
            max_requests_per_client=settings.max_requests_per_client,
            grammars=grammars_of(engine),
            tool_call_format=settings.tool_call_format,
            reasoning=_reasoning(template, engine, settings.reasoning_format),
            reasoning_budget=settings.reasoning_budget,
            in_flight_counts=in_flight if in_flight is not None else collections.Counter(),
        )
        served = cls(
            id=model_id,
            engine=engine,
            scheduler=scheduler,
            tokenizing=tokenizing,
            generations=generations,
            chat_template=template,
            max_new_tokens=max_new_tokens,
        )
        if metrics is not None:
            scheduler.on_step = step_observer(metrics, scheduler, model_id)
        return served

    def model_info(self) -> p.ModelInfo:
        """What the ``info`` reply says of it."""
        info = self.info
        return p.ModelInfo(
            name=info.model_name,
            engine=info.engine,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            bos_token_id=info.bos_token_id,
            eos_token_ids=tuple(sorted(info.eos_token_ids)),
            max_batch=info.max_batch,
            batching=info.batching,
            constraints=info.constraints,
            kernels=info.kernels,
        )

    def cut_short(self) -> str:
        """Why a request of this model ends before its generation did: its
        unload, else the server's shutdown."""
        if self.unloading and not self.generations.draining_message.startswith("the server"):
            return f"the model {self.id!r} was unloaded"
        return "the server is shutting down"

    def in_flight(self) -> int:
        """Generations of this model not yet closed."""
        return self.generations.open_count


def step_observer(
    metrics: Metrics, scheduler: Scheduler, source: str = ""
) -> Callable[[StepRecord], None]:
    """The scheduler's ``on_step``: the step's time and batch, the queue, and
    the engine's memory and prefix cache into ``metrics``."""

    def on_step(record: StepRecord) -> None:
        metrics.step(record.duration, record.batch)
        stats = scheduler.statistics()
        metrics.jobs(running=stats.running, waiting=stats.waiting, source=source)
        engine = record.engine_statistics
        if engine is None:
            return
        # Duck-typed: the CPU engine's statistics (importing its class would
        # import torch here); an engine whose statistics differ reports nothing.
        with contextlib.suppress(AttributeError):
            metrics.engine_memory(
                kv_cache_bytes=engine.kv_cache_bytes,
                weight_bytes=engine.weight_bytes,
                kv_cache_capacity_bytes=engine.kv_cache_capacity_bytes,
                source=source,
            )
            prefix = engine.prefix_cache
            metrics.prefix_cache(
                size_bytes=prefix.bytes,
                capacity_bytes=prefix.capacity_bytes,
                hits=prefix.hits,
                misses=prefix.misses,
                evictions=prefix.evictions,
                source=source,
            )
            metrics.prefill_deferrals(engine.prefill_deferrals, source)

    return on_step


def _thinking_markers(template: ChatTemplate | None, engine: Engine) -> ReasoningFormat | None:
    """The template's thinking markers; of several pairs, the one whose
    markers are single tokens of the model's tokenizer."""
    if template is None:
        return None
    vocabulary = [
        marker
        for pair in KNOWN_MARKERS
        for marker in pair
        if marker in template.source and len(engine.encode(marker)) == 1
    ]
    return reasoning_format(template.source, vocabulary)


def _reasoning(template: ChatTemplate | None, engine: Engine, mode: str) -> ReasoningFormat | None:
    """The template's thinking markers, unless ``--reasoning-format none``."""
    found = _thinking_markers(template, engine)
    if found is not None:
        kept = "apart from the answer" if mode == "auto" else "in the answer"
        log.info(
            "the chat template thinks (%s ... %s): its reasoning is kept %s",
            found.start,
            found.end,
            kept,
        )
    return found if mode == "auto" else None


def load_template(info: EngineInfo, source_file: str | None = None) -> ChatTemplate | None:
    """The model's chat template (or ``--chat-template``'s), or None (chat
    routes then answer 400). A template file given that cannot be read or
    compiled is a :class:`ConfigError`: the operator asked for it."""
    if source_file is not None:
        try:
            return load_chat_template(info.model_dir or ".", source_file=source_file)
        except TrioserveError as exc:
            raise ConfigError(f"--chat-template: {exc}") from None
    if info.model_dir is None:
        return None
    try:
        return load_chat_template(info.model_dir)
    except NoChatTemplate:
        return None
    except TrioserveError as exc:
        log.warning("the model's chat template cannot be used: %s", exc)
        return None


def model_template(
    info: EngineInfo, settings: ModelSettings, preset_template: Path | None = None
) -> ChatTemplate | None:
    """A model's chat template: its preset's (``chat_template`` in a models
    folder's preset), else ``--chat-template``'s, else its own; None when it
    has none."""
    if preset_template is not None:
        return load_template(info, str(preset_template))
    return load_template(info, settings.chat_template)
