"""The access log and the request counters: one line per finished request,
the same for both doors.

Every line is on the logger ``trioserve.access`` with structured fields
(:mod:`trioserve.logs` writes them as ``key=value`` text or as JSON keys).
Values are plain JSON values, never Python reprs: a request id is logged as
the client sent it (``"q1"`` stays the string ``q1``, ``3`` the number 3), a
missing value is ``None`` (``-`` in text, ``null`` in JSON). An id whose JSON
text is longer than :data:`MAX_VALUE_CHARS` is cut to that many characters and
logged as a string ending in ``...``, so that a client cannot grow the log by
sending a megabyte of id.

Each line has the same keys for the same action, present or not: a log
reader need not guess which keys a line may lack.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from trioserve import protocol as p
from trioserve.generation import Generation
from trioserve.metrics import Metrics

__all__ = [
    "MAX_VALUE_CHARS",
    "ConnectionLog",
    "access_log",
    "log_infer",
    "log_openai",
    "log_request",
    "plain_value",
]

access_log = logging.getLogger("trioserve.access")

#: The longest client value (a request id) written to the log, in characters
#: of its JSON text.
MAX_VALUE_CHARS: Final = 80


def plain_value(value: Any, limit: int = MAX_VALUE_CHARS) -> Any:
    """A client's JSON value as a log field: itself when short, else a cut string."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 3] + "..."
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    if len(text) <= limit:
        return value
    return text[: limit - 3] + "..."


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _timings(generation: Generation | None) -> dict[str, Any]:
    if generation is None:
        return {
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
            "ttft_s": None,
            "tok_s": None,
        }
    return {
        "prompt_tokens": generation.prompt_tokens,
        "generated_tokens": generation.generated_tokens,
        "cached_tokens": generation.cached_tokens,
        "ttft_s": _rounded(generation.first_token_s, 4),
        "tok_s": _rounded(generation.tokens_per_second, 1),
    }


def _infer_fields(
    peer: str,
    echoed: Mapping[str, Any],
    outcome: str,
    stop_reason: str | None,
    error_type: str | None,
    generation: Generation | None,
) -> dict[str, Any]:
    return {
        "peer": peer,
        "api": "websocket",
        "action": "infer",
        "request_id": plain_value(echoed.get("request_id")),
        "outcome": outcome,
        "stop_reason": stop_reason,
        "error_type": error_type,
        **_timings(generation),
        "queue_s": None if generation is None else round(generation.queued_s, 4),
    }


def log_infer(
    metrics: Metrics,
    peer: str,
    request: p.InferRequest,
    generation: Generation,
    reply: p.Reply,
    *,
    cancel_cause: str | None = None,
    log_prompts: bool = False,
) -> None:
    """Count and log one finished WebSocket ``infer``: its outcome is the
    final frame's stop reason, or the error frame's type."""
    stop_reason = error_type = None
    if isinstance(reply, p.InferFinal):
        stop_reason = reply.stop_reason
    elif isinstance(reply, p.ErrorReply):
        error_type = reply.error.type
    outcome = stop_reason or error_type or "internal"
    metrics.request_finished(
        api="websocket",
        action="infer",
        outcome=outcome,
        prompt_tokens=generation.prompt_tokens,
        generated_tokens=generation.generated_tokens,
        cached_tokens=generation.cached_tokens,
        duration=generation.total_s,
        model=generation.generations.model_id,
    )
    if generation.job is not None and generation.job.started_at is not None:
        metrics.queue_wait(generation.queued_s, model=generation.generations.model_id)
    if outcome == "interrupted":
        metrics.cancelled(cancel_cause or "disconnect")
    fields = _infer_fields(peer, request.echoed, outcome, stop_reason, error_type, generation)
    if generation.generations.model_id is not None:
        fields["model"] = generation.generations.model_id
    if log_prompts:
        fields["prompt"] = generation.util_text or generation.request.describe_prompt()
    access_log.info("infer done", extra={"fields": fields})


def log_request(
    metrics: Metrics,
    peer: str,
    action: str | None,
    echoed: Mapping[str, Any],
    *,
    error_type: str | None = None,
    quiet: bool = False,
    **extra: Any,
) -> None:
    """Count and log one WebSocket action other than a finished ``infer``
    (an ``infer`` refused before it started included): ``echo`` and
    ``info``, which clients use as pings, at DEBUG unless they failed; the
    others at INFO. ``action`` and ``echoed`` are what could be read of the
    frame, so that a refused frame is logged with its action and id."""
    outcome = error_type or "ok"
    # A client's unknown action is logged, but never becomes a metrics label.
    known = action if action in p.ACTIONS else "unknown"
    metrics.request_finished(api="websocket", action=known, outcome=outcome)
    level = logging.DEBUG if quiet and error_type is None else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    fields: dict[str, Any]
    if action == "infer":
        # Refused before it started: the keys of every infer line.
        fields = {**_infer_fields(peer, echoed, outcome, None, error_type, None), **extra}
    else:
        fields = {
            "peer": peer,
            "api": "websocket",
            "action": plain_value(action),
            "request_id": plain_value(echoed.get("request_id")),
            "outcome": outcome,
            "error_type": error_type,
            **extra,
        }
    name = known if known != "unknown" else "request"
    access_log.log(level, "%s done", name, extra={"fields": fields})


def _choices_timings(choices: Sequence[Generation]) -> dict[str, Any]:
    """The figures of a request's choices: the prompt once (the first
    choice's), the generated tokens of all, the first token's time, and
    the decode rate over all choices together."""
    if len(choices) <= 1:
        return _timings(choices[0] if choices else None)
    first = choices[0]
    generated = sum(c.generated_tokens for c in choices)
    starts = [c.first_token_at for c in choices if c.first_token_at is not None]
    ends = [c.ended_at for c in choices if c.ended_at is not None]
    counted = generated - len(starts)  # after each choice's first token
    span = max(ends) - min(starts) if starts and len(ends) == len(choices) else 0.0
    return {
        "prompt_tokens": first.prompt_tokens,
        "generated_tokens": generated,
        "cached_tokens": first.cached_tokens,
        "ttft_s": _rounded(first.first_token_s, 4),
        "tok_s": _rounded(counted / span if span > 0 and counted > 0 else None, 1),
        "choices": len(choices),
    }


def log_openai(
    metrics: Metrics | None,
    peer: str,
    action: str,
    choices: Sequence[Generation],
    outcome: str,
    *,
    duration: float,
    cancel_cause: str,
    api: str = "openai",
) -> None:
    """Count and log one finished OpenAI (or Anthropic: ``api``) request (``choices``: its
    generations, none when it was refused before any); ``cancel_cause`` is
    counted when it was interrupted."""
    timings = _choices_timings(choices)
    if metrics is not None:
        metrics.request_finished(
            api=api,
            action=action,
            outcome=outcome,
            prompt_tokens=timings["prompt_tokens"],
            generated_tokens=timings["generated_tokens"],
            cached_tokens=timings["cached_tokens"],
            duration=duration,
            model=choices[0].generations.model_id if choices else None,
        )
        if choices and outcome == "interrupted":
            metrics.cancelled(cancel_cause)
    fields: dict[str, Any] = {
        "peer": peer,
        "api": api,
        "action": action,
        "outcome": outcome,
        **timings,
        "total_s": round(duration, 4),
    }
    if choices and choices[0].generations.model_id is not None:
        fields["model"] = choices[0].generations.model_id
    access_log.info("%s done", action, extra={"fields": fields})


@attrs.frozen
class ConnectionLog:
    """:func:`log_infer` and :func:`log_request` for one WebSocket connection."""

    metrics: Metrics
    peer: str
    log_prompts: bool = False

    def infer(
        self,
        request: p.InferRequest,
        generation: Generation,
        reply: p.Reply,
        cancel_cause: str | None = None,
    ) -> None:
        log_infer(
            self.metrics,
            self.peer,
            request,
            generation,
            reply,
            cancel_cause=cancel_cause,
            log_prompts=self.log_prompts,
        )

    def request(self, request: p.Request, **extra: Any) -> None:
        log_request(self.metrics, self.peer, p.action_name(request), request.echoed, **extra)

    def refused(self, error: p.ProtocolError) -> None:
        """A frame answered with an error frame: logged with what could be
        read of it (a refused ``infer`` as an ``infer``, with its id)."""
        log_request(
            self.metrics, self.peer, error.action, error.echoed, error_type=error.error_type
        )
