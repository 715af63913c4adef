"""What the OpenAI parsers share: the field error, and how values are shown
and checked in messages."""

from __future__ import annotations

from typing import Any, Final, TypeGuard

__all__ = ["UNSUPPORTED", "BadParam", "is_text", "show"]

#: ``code`` of a 400 for a feature this server does not implement.
UNSUPPORTED: Final = "unsupported_parameter"


class BadParam(ValueError):
    """A field broke its rule; carries the OpenAI ``param`` path."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        #: ``unsupported_parameter`` for a feature this server does not
        #: implement (docs/openai.md, "Refused unless they ask for nothing").
        self.code = code


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_text(value: Any) -> TypeGuard[str]:
    """A str that is valid Unicode (json's ``\\udXXX`` escapes can make lone
    surrogates, which no tokenizer takes and no reply can carry)."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
