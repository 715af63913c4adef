"""Other servers' request fields that clients and gateways send to an OpenAI
API: vLLM's and SGLang's, declared once for the chat, completions and
Responses doors. No I/O.

SGLang's Model Gateway re-serializes every body it routes and writes its
engine's fields at their defaults (``no_stop_trim``, ``ignore_eos``,
``skip_special_tokens``, ``separate_reasoning``, ``return_hidden_states``
...), and vLLM's clients send vLLM's (``ignore_eos``,
``continue_final_message``, ``include_stop_str_in_output``). Each field here
either works as its server documents it (:class:`Extras` carries it to the
generation) or, where it has no meaning here, is accepted at its no-op value
and refused by name at any other: a request is never answered as if a field
it sent had been honoured when it was not.

:func:`extension_table` renders the declarations for ``docs/openai.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from .errors import invalid as _invalid
from .params import UNSUPPORTED, show

__all__ = [
    "EXTENSIONS",
    "EXTENSION_NAMES",
    "Door",
    "Extension",
    "Extras",
    "extension_table",
    "read_extras",
]

#: The doors these fields are read on.
Door: TypeAlias = Literal["chat", "completions", "responses"]
_ALL: Final[frozenset[Door]] = frozenset({"chat", "completions", "responses"})
_CHAT: Final[frozenset[Door]] = frozenset({"chat"})
_DOOR_ROUTES: Final[Mapping[Door, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}


@attrs.frozen(kw_only=True)
class Extras:
    """What the fields of :data:`EXTENSIONS` asked for, at their defaults
    when absent (or null)."""

    #: Keep generating past the model's end-of-sequence tokens, up to the
    #: length limit (the request's own ``stop_token_ids`` still stop it).
    ignore_eos: bool = False
    #: Leave special tokens' text (``<|im_start|>``, ...) out of the output.
    skip_special_tokens: bool = True
    #: End the output with the stop string that ended it.
    include_stop: bool = False
    #: Go on writing the final assistant message (chat).
    continue_final_message: bool = False
    #: Give a thinking template's reasoning apart (chat).
    separate_reasoning: bool = True
    #: Stream the reasoning as it comes, else in one chunk at its end (chat).
    stream_reasoning: bool = True


@attrs.frozen
class Extension:
    """One field: its name, the doors that read it, its default, and what
    it does here."""

    name: str
    doors: frozenset[Door]
    default: bool | int
    #: The :class:`Extras` attribute it sets; None for a field accepted only
    #: at ``default`` (it has no meaning here).
    sets: str | None
    meaning: str
    #: The servers whose field it is.
    origin: str
    #: For a field accepted only at its default: why another value is refused.
    refused: str = ""
    #: Read it as an integer (else true or false).
    integer: bool = False


#: Every field, in the order ``docs/openai.md`` lists them.
EXTENSIONS: Final[tuple[Extension, ...]] = (
    Extension(
        "ignore_eos",
        _ALL,
        False,
        "ignore_eos",
        "keep generating past the model's end-of-sequence token, up to the length limit"
        " (a request's own `stop_token_ids` and `stop` still end it, and an output format's"
        " complete value): for benchmarks",
        "vLLM, SGLang",
    ),
    Extension(
        "skip_special_tokens",
        _ALL,
        True,
        "skip_special_tokens",
        "leave special tokens' text (`<|im_start|>`, ...) out of the output and its logprobs'"
        " `token`; `false` writes it. A thinking template's and the tool calls' markers, and a"
        " special token a `stop` string holds, are always written",
        "vLLM, SGLang",
    ),
    Extension(
        "no_stop_trim",
        _ALL,
        False,
        "include_stop",
        "end the output with the stop string (`stop`) that ended it (its tokens' logprobs too)",
        "SGLang",
    ),
    Extension(
        "include_stop_str_in_output",
        _ALL,
        False,
        "include_stop",
        "the same as `no_stop_trim`",
        "vLLM",
    ),
    Extension(
        "continue_final_message",
        _CHAT,
        False,
        "continue_final_message",
        "the final message is the assistant's and is continued: the reply holds what"
        " follows it (no new turn is opened; the chat is rendered with it as its last turn,"
        " cut where its text ends, as transformers' `continue_final_message` does)",
        "vLLM, SGLang",
    ),
    Extension(
        "add_generation_prompt",
        _CHAT,
        True,
        None,
        "opens the assistant's turn; `false` only with `continue_final_message: true`",
        "vLLM",
        refused="a reply is generated in an assistant turn: false is taken only with"
        " continue_final_message true",
    ),
    Extension(
        "separate_reasoning",
        _CHAT,
        True,
        "separate_reasoning",
        "a thinking template's reasoning apart, in `reasoning_content`; `false` leaves it"
        " in `content` as the model wrote it, markers and all (the server's thinking budget"
        " and an output format after the thinking hold all the same)",
        "SGLang",
    ),
    Extension(
        "stream_reasoning",
        _CHAT,
        True,
        "stream_reasoning",
        "stream the reasoning as it is written; `false` sends it in one chunk when it ends"
        " (nothing is sent meanwhile: mind a proxy's idle timeout)",
        "SGLang",
    ),
    Extension(
        "return_hidden_states",
        _ALL,
        False,
        None,
        "accepted as `false`",
        "SGLang",
        refused="hidden states are not returned by this server",
    ),
    Extension(
        "priority",
        _ALL,
        0,
        None,
        "accepted as `0`: requests are scheduled fairly between clients instead",
        "vLLM, SGLang",
        refused="priority scheduling is not implemented: requests are scheduled fairly"
        " between clients",
        integer=True,
    ),
)

#: Every field's name.
EXTENSION_NAMES: Final = frozenset(e.name for e in EXTENSIONS)
_BY_NAME: Final[Mapping[str, Extension]] = {e.name: e for e in EXTENSIONS}


def _value(extension: Extension, value: Any) -> bool | int:
    name = extension.name
    if extension.integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(f"{name} must be an integer, got {show(value)}", name)
        return value
    if not isinstance(value, bool):
        raise _invalid(f"{name} must be true or false, got {show(value)}", name)
    return value


def read_extras(fields: Mapping[str, Any], door: Door) -> Extras:
    """The fields of :data:`EXTENSIONS` a body gave (``fields``, by name),
    read for ``door``; raises :class:`OpenAIError` (400) naming the field."""
    values: dict[str, bool] = {}
    given_by: dict[str, str] = {}
    for name, raw in fields.items():
        extension = _BY_NAME[name]
        if raw is None:
            continue  # null is the default
        if door not in extension.doors:
            routes = ", ".join(_DOOR_ROUTES[d] for d in sorted(extension.doors))
            raise _invalid(f"{name} is taken on {routes} only", name, UNSUPPORTED)
        value = _value(extension, raw)
        target = extension.sets
        if target is None:
            if value != extension.default and not _allowed_here(extension, fields):
                raise _invalid(f"{name}: {extension.refused}; got {show(raw)}", name, UNSUPPORTED)
            continue
        assert isinstance(value, bool)
        other = given_by.get(target)
        if other is not None and values[target] != value:
            raise _invalid(f"give {other} or {name}, not both with different values", name)
        values[target] = value
        given_by[target] = name
    return Extras(**values)


def _allowed_here(extension: Extension, fields: Mapping[str, Any]) -> bool:
    """``add_generation_prompt: false`` goes with ``continue_final_message``."""
    return (
        extension.name == "add_generation_prompt" and fields.get("continue_final_message") is True
    )


def extension_table() -> str:
    """The Markdown table of :data:`EXTENSIONS` for ``docs/openai.md``."""
    lines = [
        "| field | routes | default | here | from |",
        "|---|---|---|---|---|",
    ]
    for extension in EXTENSIONS:
        routes = (
            "all three"
            if extension.doors == _ALL
            else ", ".join(f"`{_DOOR_ROUTES[d]}`" for d in sorted(extension.doors))
        )
        default = str(extension.default).lower()
        lines.append(
            f"| `{extension.name}` | {routes} | `{default}` | {extension.meaning}"
            f" | {extension.origin} |"
        )
    return "\n".join(lines)
