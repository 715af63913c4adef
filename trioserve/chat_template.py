"""A model's own chat template, rendered as the Hugging Face ecosystem renders it.

Chat models ship a Jinja template that turns a list of messages into the one
prompt string the model was trained on (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file beside it; the
converter of the embedded model writes both). :class:`ChatTemplate` renders it
the way ``transformers``' ``apply_chat_template`` does, so that a prompt built
here is the prompt the model expects:

* jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, and the ``loopcontrols`` extension;
* the globals ``raise_exception(message)`` and ``strftime_now(format)``, and a
  ``tojson`` filter that does not escape HTML (``ensure_ascii=False`` by
  default, with ``indent``/``separators``/``sort_keys``);
* the ``{% generation %}`` block tag (used by templates that mark assistant
  text for training) renders its body;
* the variables ``messages``, ``add_generation_prompt``, ``tools``,
  ``documents`` and the tokenizer's special tokens (``bos_token``,
  ``eos_token``, ``unk_token``, ``pad_token``) where it defines them.

The template is a file of the model, chosen by whoever runs the server; the
messages are a client's. The sandbox keeps the template away from Python
internals, and each render is bounded so that large or hostile *messages*
cannot make a template run long or build huge strings: a deadline checked on
every call, item and attribute access and every output chunk; a budget of
``range`` items for the whole render; size checks on ``+``, ``*`` and ``%``
before they build a string or list; and a cap on the output. A template
written to burn CPU without touching any of those (the operator's own file)
is outside what this module defends against.

This module knows nothing of trio or torch; rendering is synchronous.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from trioserve.errors import ModelError, TrioserveError

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "NoChatTemplate",
    "load_chat_template",
]

#: Special tokens of a tokenizer that templates may use, as transformers
#: passes them (its ``special_tokens_map``).
SPECIAL_TOKEN_NAMES: Final = ("bos_token", "eos_token", "unk_token", "pad_token")

DEFAULT_MAX_RENDER_SECONDS: Final = 1.0
DEFAULT_MAX_OUTPUT_CHARS: Final = 8 * 1024 * 1024
#: Items all ``range()`` calls of one render may produce together. Templates
#: use ``range`` over message indexes; a million is far beyond that.
DEFAULT_MAX_RANGE_ITEMS: Final = 1_000_000


class ChatTemplateError(TrioserveError):
    """The chat template cannot render these messages (it refused them with
    ``raise_exception``, failed on them, or went past a bound). The message
    is for the client: lowercase, no traceback."""


class NoChatTemplate(ChatTemplateError):
    """The model has no chat template, so chat requests cannot be served."""


class _RenderBudget:
    """The bounds of one render, checked from inside the sandbox."""

    def __init__(self, max_seconds: float, max_chars: int, max_range_items: int) -> None:
        self.deadline = time.monotonic() + max_seconds
        self.max_seconds = max_seconds
        self.max_chars = max_chars
        self.range_left = max_range_items

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"rendering the chat template took longer than {self.max_seconds:g} s"
            )

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise ChatTemplateError(
                f"the chat template built {what} of {size} items or characters, "
                f"more than the limit of {self.max_chars}"
            )


_budget: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar(
    "trioserve_chat_template_budget", default=None
)


def _current_budget() -> _RenderBudget:
    budget = _budget.get()
    if budget is None:  # pragma: no cover - every render sets one
        raise ChatTemplateError("the chat template was used outside a render")
    return budget


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple | bytes) else None


def _raise_exception(message: Any) -> None:
    # transformers raises jinja2's TemplateError: templates use it to refuse
    # conversations they cannot format (roles that do not alternate, ...).
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which no prompt wants.
    text = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    _current_budget().check_size(len(text), "a json string")
    return text


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _budgeted_range(*args: int) -> range:
    budget = _current_budget()
    budget.check_time()
    items = range(*args)
    if len(items) > budget.range_left:
        raise ChatTemplateError(
            "the chat template asked range() for more items than a render may use "
            f"({len(items)} with {budget.range_left} left)"
        )
    budget.range_left -= len(items)
    return items


#: A printf-style conversion's width and precision (``%-010.5d``, ``%*s``).
_PRINTF_SIZES: Final = re.compile(r"%[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")


def _check_format_widths(fmt: str, args: Any, budget: _RenderBudget) -> None:
    """Refuse ``'%0999999999d' % 1`` before Python builds the string."""
    stars = isinstance(args, tuple) and any(
        isinstance(a, int) and a > budget.max_chars for a in args
    )
    for match in _PRINTF_SIZES.finditer(fmt):
        for size in match.groups():
            if size == "*" and stars:
                budget.check_size(budget.max_chars + 1, "a formatted string")
            elif size is not None and size != "*":
                budget.check_size(int(size), "a formatted string")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers tracks where
    assistant text is for training masks; for a prompt only the body matters."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's declared interface

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The ecosystem's sandbox, plus the render bounds of :class:`_RenderBudget`."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        budget = _current_budget()
        budget.check_time()
        if op == "+":
            a, b = _sized(left), _sized(right)
            if a is not None and b is not None:
                budget.check_size(a + b, "a string or list")
        elif op == "*":
            for seq, count in ((left, right), (right, left)):
                size = _sized(seq)
                if size is not None and isinstance(count, int):
                    budget.check_size(size * max(count, 0), "a repeated string or list")
        elif (
            op == "**"
            and isinstance(left, int | float)
            and isinstance(right, int | float)
            and abs(right) > 64
        ):
            raise ChatTemplateError(f"the chat template raised a number to the power {right!r}")
        elif op == "%" and isinstance(left, str):
            _check_format_widths(left, right, budget)
        result = super().call_binop(context, op, left, right)
        if op == "%":
            size = _sized(result)
            if size is not None:
                budget.check_size(size, "a formatted string")
        return result

    def call(
        __self,  # jinja2's signature: the prefixes avoid clashes with keyword arguments
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = _current_budget()
        budget.check_time()
        result = super().call(__context, __obj, *args, **kwargs)
        size = _sized(result)
        if size is not None:
            budget.check_size(size, "a value")
        return result

    def getitem(self, obj: Any, argument: Any) -> Any:
        _current_budget().check_time()
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _current_budget().check_time()
        return super().getattr(obj, attribute)


def _environment() -> _BoundedSandbox:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _budgeted_range
    return env


@attrs.frozen(kw_only=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may use.

    Build one with :meth:`from_string` or :func:`load_chat_template`; render
    with :meth:`render`. Immutable and safe to share between threads.
    """

    source: str
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)
    max_render_seconds: float = DEFAULT_MAX_RENDER_SECONDS
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    max_range_items: int = DEFAULT_MAX_RANGE_ITEMS
    _template: jinja2.Template = attrs.field(repr=False, eq=False, alias="template")

    @classmethod
    def from_string(
        cls,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        max_render_seconds: float = DEFAULT_MAX_RENDER_SECONDS,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_range_items: int = DEFAULT_MAX_RANGE_ITEMS,
    ) -> ChatTemplate:
        """Compile ``source``; raise :class:`~trioserve.errors.ModelError`
        when it is not a valid template (that is the model's fault, found once
        at load, never a client's)."""
        try:
            template = _compiled(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelError(
                f"the chat template is not valid jinja: {exc.message} (line {exc.lineno})"
            ) from None
        return cls(
            source=source,
            special_tokens=dict(special_tokens or {}),
            max_render_seconds=max_render_seconds,
            max_output_chars=max_output_chars,
            max_range_items=max_range_items,
            template=template,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and
        ``content``, and whatever else the template reads).

        Raises :class:`ChatTemplateError` when the template refuses the
        messages, fails on them, or goes past a bound; nothing else escapes.
        """
        budget = _RenderBudget(self.max_render_seconds, self.max_output_chars, self.max_range_items)
        context = {
            **self.special_tokens,
            **variables,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": documents,
        }
        token = _budget.set(budget)
        try:
            return self._render(context, budget)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception(...) and undefined names, sandbox violations.
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("the chat template ran out of memory") from None
        except Exception as exc:
            # A template error in plain Python terms ('str' + None, a bad
            # index ...): the messages did not have the shape it expects.
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            _budget.reset(token)

    def _render(self, context: dict[str, Any], budget: _RenderBudget) -> str:
        parts: list[str] = []
        size = 0
        chunks: Iterator[str] = self._template.generate(context)
        for chunk in chunks:
            size += len(chunk)
            budget.check_size(size, "a prompt")
            budget.check_time()
            parts.append(chunk)
        return "".join(parts)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an
    AddedToken dict with its text under ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_named(templates: Sequence[Any], where: Path) -> str:
    """transformers' rule for a list of named templates: the one named
    ``default`` (others, such as ``tool_use``, need tools)."""
    for entry in templates:
        if (
            isinstance(entry, Mapping)
            and entry.get("name") == "default"
            and isinstance(entry.get("template"), str)
        ):
            return str(entry["template"])
    raise ModelError(f"{where}: chat_template lists named templates but none named 'default'")


def load_chat_template(
    model_dir: str | Path, *, source_file: str | Path | None = None, **bounds: Any
) -> ChatTemplate:
    """The chat template of the Hugging Face model directory ``model_dir``.

    Looks, in transformers' order of preference, for ``chat_template.jinja``,
    then ``chat_template.json`` (``{"chat_template": ...}``), then the
    ``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list
    of named templates of which ``default`` is used). Special tokens come from
    ``tokenizer_config.json``. ``source_file`` (``--chat-template``) replaces
    the model's own template, its special tokens kept. ``bounds`` go to
    :meth:`ChatTemplate.from_string`.

    Raises :class:`NoChatTemplate` when the model has none, and
    :class:`~trioserve.errors.ModelError` when a file is unreadable or the
    template is not valid Jinja.
    """
    root = Path(model_dir)
    config_path = root / "tokenizer_config.json"
    config: Mapping[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {config_path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ModelError(f"{config_path} does not hold a json object")
        config = loaded
    special_tokens = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
    }

    source: str | None = None
    if source_file is not None:
        try:
            source = Path(source_file).read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read the chat template {source_file}: {exc}") from None
        return ChatTemplate.from_string(source, special_tokens=special_tokens, **bounds)
    jinja_path = root / "chat_template.jinja"
    json_path = root / "chat_template.json"
    try:
        if jinja_path.is_file():
            source = jinja_path.read_text(encoding="utf-8")
        elif json_path.is_file():
            entry = json.loads(json_path.read_text(encoding="utf-8"))
            if isinstance(entry, dict) and isinstance(entry.get("chat_template"), str):
                source = entry["chat_template"]
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the chat template of {root}: {exc}") from None
    if source is None:
        entry = config.get("chat_template")
        if isinstance(entry, str):
            source = entry
        elif isinstance(entry, list):
            source = _pick_named(entry, config_path)
    if source is None:
        raise NoChatTemplate(
            f"the model {root.name!r} has no chat template (no chat_template.jinja, and no "
            "chat_template in tokenizer_config.json): send a prompt to /v1/completions "
            "or the infer action instead"
        )
    return ChatTemplate.from_string(source, special_tokens=special_tokens, **bounds)


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    """``source`` compiled (once per text: a server of several models loads
    the same templates again and again, and compiling one holds the GIL for
    tens of milliseconds). A compiled template keeps no state between
    renders."""
    return _environment().from_string(source)
