"""What the protocol's replies mean, as pure functions: the name of a
request's action, and the final frame of an ``infer`` from how its
generation ended (protocol section 3.4). The server's connection calls them;
they know no socket and no scheduler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from trioserve.vocabulary.results import Finished, TokenLogprob

from ._messages import (
    EchoRequest,
    EstimateTokenRequest,
    InferRequest,
    InfoRequest,
    LefttrimTokenRequest,
    Request,
    StopRequest,
)
from ._replies import (
    InferChunk,
    InferFinal,
    Timing,
    Usage,
)

__all__ = ["action_name", "infer_chunk", "infer_final", "logprob_entries"]

_ACTION_OF: Final[Mapping[type[Any], str]] = {
    EchoRequest: "echo",
    EstimateTokenRequest: "estimate_token",
    LefttrimTokenRequest: "lefttrim_token",
    InferRequest: "infer",
    StopRequest: "stop",
    InfoRequest: "info",
}


def action_name(request: Request | None) -> str | None:
    """The ``action`` of a decoded request (None for none)."""
    if request is None:
        return None
    return _ACTION_OF.get(type(request))


def logprob_entries(entries: Sequence[TokenLogprob]) -> tuple[dict[str, Any], ...]:
    """Log-probability entries as the wire writes them: ``token_id``,
    ``token`` (its text), ``bytes`` (its UTF-8 bytes as numbers), ``logprob``,
    and ``top_logprobs`` (the alternatives, each with the same fields but
    ``top_logprobs``)."""

    def one(entry: TokenLogprob) -> dict[str, Any]:
        return {
            "token_id": entry.token,
            "token": entry.text,
            "bytes": list(entry.bytes),
            "logprob": entry.logprob,
        }

    return tuple({**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries)


def infer_chunk(
    request: InferRequest,
    *,
    chunk: str,
    util_text: str,
    response: str,
    logprobs: Sequence[TokenLogprob] = (),
) -> InferChunk:
    """A chunk frame of ``request``: ``util_text`` unless the client asked
    for compact chunks, the response so far when it asked for full ones,
    the chunk's log-probability entries when it asked for them."""
    return InferChunk(
        chunk=chunk,
        util_text=None if request.compact_chunks else util_text,
        response=response if request.stream_full else None,
        logprobs=None if request.logprobs is None else logprob_entries(logprobs),
        echoed=request.echoed,
    )


def infer_final(
    request: InferRequest,
    finished: Finished | None,
    *,
    response: str,
    util_text: str,
    usage: Usage,
    queued_s: float,
    first_token_s: float | None,
    total_s: float,
    logprobs: Sequence[TokenLogprob] = (),
    reasoning: str = "",
) -> InferFinal:
    """The final frame of ``request``: ``finished`` says how its generation
    ended (None: it was interrupted, by a stop, a disconnect or a shutdown)."""
    stop_reason: Any = "interrupted"
    eos_reason: Any = None
    stop_string = stop_token = None
    if finished is not None:
        if finished.reason == "max_new_tokens":
            stop_reason = "num_tokens"
        else:
            stop_reason = "eos"
            eos_reason = finished.reason
            stop_string = finished.stop_string
            stop_token = finished.stop_token
    return InferFinal(
        response=response,
        util_text=util_text or request.custom_bos + (request.text or ""),
        stop_reason=stop_reason,
        eos_reason=eos_reason,
        stop_string=stop_string,
        stop_token=stop_token,
        usage=usage,
        timing=Timing(
            queued_s=round(queued_s, 6),
            first_token_s=None if first_token_s is None else round(first_token_s, 6),
            total_s=round(total_s, 6),
        ),
        logprobs=None if request.logprobs is None else logprob_entries(logprobs),
        reasoning=reasoning or None,
        echoed=request.echoed,
    )
