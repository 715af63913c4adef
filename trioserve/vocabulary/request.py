"""The declared generation request: what to generate, whichever door asked
for it. Each door maps its wire request onto one :class:`GenerationRequest`
(``trioserve.server.doors``); the pipeline checks it against the model, fits
it to the context and turns it into an engine job
(:mod:`trioserve.generation.request`). No torch, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

from .constraint import Constraint
from .sampling import SamplingSettings
from .tools import ToolUse

__all__ = ["Fit", "GenerationRequest"]


#: What to do with a prompt that leaves less room than ``max_new_tokens``:
#: ``trim`` keeps its end (the WebSocket ``infer``, protocol.md 3.4), ``refuse``
#: answers ``context_length_exceeded`` (OpenAI: a chat must not be answered
#: as if cut short).
Fit: TypeAlias = Literal["trim", "refuse"]


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """What to generate, whatever door asked for it. The prompt is one of
    ``text`` (with ``custom_bos`` before it), ``messages`` (rendered with the
    model's chat template) or ``prompt_ids``."""

    text: str = ""
    custom_bos: str = ""
    #: A chat as the template reads it (``{"role", "content", ...}`` each).
    messages: tuple[Mapping[str, Any], ...] | None = None
    #: With ``messages``: the start of the reply, written by the client (a
    #: final assistant message, Anthropic's "prefill"). The prompt ends with
    #: it and the model goes on from there; the reply holds only what follows.
    assistant_prefix: str = ""
    #: A thinking template's section on (True) or off (False: the template's
    #: ``enable_thinking`` false), or the template's default (None).
    thinking: bool | None = None
    #: At most this many tokens of thinking, then the section is closed.
    thinking_budget: int | None = None
    prompt_ids: tuple[int, ...] | None = None
    #: None: as many as the context leaves, up to the server's cap (and up
    #: to ``default_max_new_tokens`` when that is set).
    max_new_tokens: int | None
    #: The door's default for an absent ``max_new_tokens`` (16 for an OpenAI
    #: completion): an upper bound, never an error, whatever room is left.
    default_max_new_tokens: int | None = None
    fit: Fit = "trim"
    sampling: SamplingSettings = attrs.field(factory=SamplingSettings)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    banned_ids: tuple[int, ...] = ()
    token_healing: bool = False
    #: The output must match this (at most one constraint per request).
    constraint: Constraint | None = None
    #: The tools the model may call (chat only).
    tools: ToolUse | None = None
    #: Each generated token's log probability with this many alternatives.
    logprobs: int | None = None
    #: Each prompt token's, with this many; ``max_new_tokens`` may then be 0.
    prompt_logprobs: int | None = None
    #: Generate past the model's end-of-sequence tokens (up to the length
    #: limit or a stop of the request's own).
    ignore_eos: bool = False
    #: Leave special tokens' text out of the reply (the API doors; the
    #: WebSocket protocol writes it, as ExLlamaV2's server does).
    skip_special_tokens: bool = False
    #: End the reply with the stop string that ended it.
    include_stop_str: bool = False
    #: Give a thinking template's reasoning apart from the answer (false:
    #: the answer holds it, as the model wrote it).
    separate_reasoning: bool = True

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    def describe_prompt(self) -> str:
        """The prompt as text, for logs (before it is rendered or tokenized)."""
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return self.custom_bos + self.text
