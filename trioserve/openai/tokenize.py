"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, bodies in, typed requests out, answers in vLLM's
shape. No I/O, no trio, no torch.

Clients that score text through ``/v1/completions`` with token-id prompts
need the server's own tokenizer to cut a context from its continuation:
lm-evaluation-harness's ``local-completions`` asks these routes
(``tokenizer_backend=remote``, chosen by itself when ``/tokenizer_info``
answers) instead of downloading the model's tokenizer from a hub.

``/tokenize`` gives exactly the ids a text prompt of ``/v1/completions``
becomes: special-token strings become their ids and no BOS is added
(``add_special_tokens`` is read and changes nothing). Both requests are
bounded (:class:`TokenizerLimits`) before any tokenizing, and ``/detokenize``
checks every id against the model's vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from trioserve.vocabulary.rules import as_int

from .errors import OpenAIError, invalid
from .params import UNSUPPORTED, is_text, show
from .requests import _parse_body as parse_body

__all__ = [
    "DetokenizeRequest",
    "TokenizeRequest",
    "TokenizerLimits",
    "detokenize_response",
    "parse_detokenize_request",
    "parse_tokenize_request",
    "requested_model",
    "tokenize_response",
    "tokenizer_info_response",
]


@attrs.frozen
class TokenizerLimits:
    """Bounds on the tokenizer routes, checked before any tokenizing: they
    keep one request's work and its answer small (an answer of ``max_ids``
    ids is about 0.5 MB of JSON)."""

    #: Characters of a ``/tokenize`` prompt.
    max_chars: int = 262_144
    #: Ids of a ``/detokenize`` request.
    max_ids: int = 65_536


DEFAULT_TOKENIZER_LIMITS: Final = TokenizerLimits()

#: vLLM's fields that change nothing here; accepted and ignored.
_IGNORED: Final = frozenset({"model", "add_special_tokens"})

#: vLLM's chat form of ``/tokenize``: refused with a 400 naming the field.
_CHAT_FIELDS: Final = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "tools",
    }
)


@attrs.frozen
class TokenizeRequest:
    """``POST /tokenize``: a text, and whether to answer each token's text."""

    prompt: str
    return_token_strs: bool = False


@attrs.frozen
class DetokenizeRequest:
    """``POST /detokenize``: token ids of the model's vocabulary."""

    tokens: tuple[int, ...]


def _bool(obj: Mapping[str, Any], name: str) -> bool:
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {show(value)}", name)
    return value


def _known(obj: Mapping[str, Any], fields: frozenset[str]) -> None:
    for key in obj:
        if key in _IGNORED or key in fields:
            continue
        if key in _CHAT_FIELDS:
            raise invalid(
                f"{key} is not supported: /tokenize takes a prompt (render messages with "
                "/v1/chat/completions's template yourself)",
                key,
                UNSUPPORTED,
            )
        raise invalid(
            f"unrecognized request argument supplied: {show(key)}", key, "unknown_parameter"
        )


def parse_tokenize_request(
    body: bytes, limits: TokenizerLimits = DEFAULT_TOKENIZER_LIMITS
) -> TokenizeRequest:
    """The body of ``POST /tokenize``; raises :class:`OpenAIError` (400,
    naming the field) for anything wrong."""
    obj = parse_body(body)
    _known(obj, frozenset({"prompt", "return_token_strs"}))
    prompt = obj.get("prompt")
    if prompt is None:
        raise invalid("prompt is required", "prompt")
    if not is_text(prompt):
        raise invalid(f"prompt must be a string, got {show(prompt)}", "prompt")
    if len(prompt) > limits.max_chars:
        raise invalid(
            f"prompt must be at most {limits.max_chars} characters, got {len(prompt)}", "prompt"
        )
    return TokenizeRequest(prompt, return_token_strs=_bool(obj, "return_token_strs"))


def parse_detokenize_request(
    body: bytes, vocab_size: int, limits: TokenizerLimits = DEFAULT_TOKENIZER_LIMITS
) -> DetokenizeRequest:
    """The body of ``POST /detokenize`` for a model of ``vocab_size`` ids;
    raises :class:`OpenAIError` (400, naming the field) for anything wrong."""
    obj = parse_body(body)
    _known(obj, frozenset({"tokens"}))
    tokens = obj.get("tokens")
    if tokens is None:
        raise invalid("tokens is required", "tokens")
    if not isinstance(tokens, list):
        raise invalid(f"tokens must be a list of token ids, got {show(tokens)}", "tokens")
    if len(tokens) > limits.max_ids:
        raise invalid(
            f"tokens may hold at most {limits.max_ids} token ids, got {len(tokens)}", "tokens"
        )
    ids: list[int] = []
    for index, item in enumerate(tokens):
        number = as_int(item)
        if number is None or not 0 <= number < vocab_size:
            raise invalid(
                f"tokens[{index}] must be a token id from 0 to {vocab_size - 1}, got {show(item)}",
                f"tokens[{index}]",
            )
        ids.append(number)
    return DetokenizeRequest(tuple(ids))


def _dump(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def tokenize_response(
    ids: Sequence[int], max_model_len: int, token_strs: Sequence[str] | None = None
) -> bytes:
    """vLLM's answer to ``/tokenize``: ``count``, ``max_model_len``,
    ``tokens`` and ``token_strs`` (null unless asked)."""
    return _dump(
        {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": list(ids),
            "token_strs": None if token_strs is None else list(token_strs),
        }
    )


def detokenize_response(text: str) -> bytes:
    """vLLM's answer to ``/detokenize``: the text as ``prompt``."""
    return _dump({"prompt": text})


def tokenizer_info_response(
    *,
    model_max_length: int,
    vocab_size: int,
    bos_token: str | None,
    eos_token: str | None,
    pad_token: str | None = None,
    chat_template: str | None = None,
) -> bytes:
    """vLLM's answer to ``GET /tokenizer_info``: the special tokens' texts,
    the model's context length and its chat template (null without one)."""
    return _dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "vocab_size": vocab_size,
            "add_bos_token": False,
            "bos_token": bos_token,
            "eos_token": eos_token,
            "pad_token": pad_token,
            "chat_template": chat_template,
        }
    )


def requested_model(body: bytes) -> str | None:
    """The ``model`` a tokenizer request names, when it names one as a
    string (anything else, a body that is not JSON included, is left to
    the request's own parser)."""
    try:
        obj = parse_body(body)
    except OpenAIError:
        return None
    model = obj.get("model")
    return model if isinstance(model, str) and is_text(model) else None
