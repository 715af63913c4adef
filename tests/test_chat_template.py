"""Chat templates: the embedded model's own (ChatML) and a Llama-3-style one,
rendered as transformers renders them, and the bounds of a render."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from trioserve.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    load_chat_template,
)
from trioserve.errors import ModelError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(role: str, content: str) -> str:
    """One ChatML turn, from the format's rules: a start marker and the role
    on one line, the content, an end marker, a newline."""
    return "<|im_start|>" + role + "\n" + content + "<|im_end|>\n"


def test_embedded_model_renders_chatml_with_its_default_system_prompt(model_dir: Path) -> None:
    template = load_chat_template(model_dir)
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = (
        chatml("system", SMOL_SYSTEM)
        + chatml("user", "What is 2+2?")
        + chatml("assistant", "4")
        + chatml("user", "And 3+3?")
        + "<|im_start|>assistant\n"
    )
    assert template.render(messages) == expected
    # Without the generation prompt the last turn is the user's.
    assert template.render(messages, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_embedded_model_keeps_a_given_system_prompt(model_dir: Path) -> None:
    template = load_chat_template(model_dir)
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello\nthere  "},
    ]
    assert template.render(messages) == (
        chatml("system", "Answer in French.")
        + chatml("user", "Hello\nthere  ")
        + "<|im_start|>assistant\n"
    )


def test_embedded_model_special_tokens(model_dir: Path) -> None:
    template = load_chat_template(model_dir)
    assert template.special_tokens["eos_token"] == "<|im_end|>"


# A Llama-3-style template, written here from that format's rules: a BOS, then
# each message as a header with its role, a blank line, the stripped content
# and <|eot_id|>; the generation prompt is an assistant header.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def llama3_dir(tmp_path: Path) -> Path:
    config = {
        "bos_token": {"content": "<|begin_of_text|>", "__type": "AddedToken"},
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_llama3_style_template_from_tokenizer_config(tmp_path: Path) -> None:
    template = load_chat_template(llama3_dir(tmp_path))
    rendered = template.render(
        [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi!"}]
    )
    assert rendered == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_raise_exception_becomes_a_chat_template_error(tmp_path: Path) -> None:
    template = load_chat_template(llama3_dir(tmp_path))
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_trim_and_lstrip_blocks_as_transformers_sets_them() -> None:
    # With trim_blocks a newline after a block tag goes; with lstrip_blocks
    # the indentation before one goes. Without them this would be "\n  a\n  b\n".
    source = (
        "{% for m in messages %}\n  {% if true %}\n{{ m['content'] }}\n  {% endif %}\n{% endfor %}"
    )
    template = ChatTemplate.from_string(source)
    assert template.render([{"content": "a"}, {"content": "b"}]) == "a\nb\n"


def test_tojson_does_not_escape_html_or_non_ascii() -> None:
    template = ChatTemplate.from_string(
        "{{ messages[0] | tojson }}|{{ messages | tojson(indent=1) }}"
    )
    rendered = template.render([{"role": "user", "content": "<b>é</b>"}])
    compact, _, indented = rendered.partition("|")
    assert compact == '{"role": "user", "content": "<b>é</b>"}'
    assert json.loads(indented) == [{"role": "user", "content": "<b>é</b>"}]


def test_generation_blocks_and_loop_controls_render() -> None:
    source = (
        "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    template = ChatTemplate.from_string(source)
    assert (
        template.render(
            [{"role": "a", "content": "1"}, {"role": "skip"}, {"role": "b", "content": "2"}]
        )
        == "[1][2]"
    )


def test_strftime_now_is_available() -> None:
    template = ChatTemplate.from_string("{{ strftime_now('%Y') }}")
    assert template.render([]).isdigit()


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    llama3_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert load_chat_template(tmp_path).render([{}, {}]) == "FILE 2"


def test_named_templates_use_default(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render([]) == "DEFAULT"


def test_a_model_without_a_template_gets_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(NoChatTemplate, match="has no chat template"):
        load_chat_template(tmp_path)
    with pytest.raises(NoChatTemplate):
        load_chat_template(tmp_path / "missing")


def test_invalid_template_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ModelError, match="not valid jinja"):
        load_chat_template(tmp_path)


def test_unreadable_tokenizer_config_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        load_chat_template(tmp_path)


# -- the sandbox and the bounds --------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_refuses_python_internals_and_mutation(source: str) -> None:
    template = ChatTemplate.from_string(source)
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ 'a' * 100000000 }}", "more than the limit"),
        ("{{ messages[0]['content'] * 1000 }}", "more than the limit"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
            "{% endfor %}{{ ns.s | length }}",
            "more than the limit",
        ),
        ("{{ '%0999999999d' % 1 }}", "more than the limit"),
        ("{{ '%.999999999f' % 1.5 }}", "more than the limit"),
        ("{{ '%*d' % (999999999, 1) }}", "more than the limit"),
        ("{{ 10 ** 100000 }}", "power"),
        ("{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}", "range"),
        (
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% for i in range(90000) %}{{ messages[0]['content'] }}{% endfor %}",
            "more than the limit",
        ),
    ],
)
def test_bounds_stop_a_render_early(source: str, match: str) -> None:
    template = ChatTemplate.from_string(source, max_output_chars=1_000_000)
    with pytest.raises(ChatTemplateError, match=match):
        template.render([{"role": "user", "content": "x" * 5000}])


def test_render_deadline() -> None:
    # Each message access checks the deadline; a zero budget fails on the first.
    template = ChatTemplate.from_string(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}", max_render_seconds=0.0
    )
    with pytest.raises(ChatTemplateError, match="took longer than"):
        template.render([{"role": "user", "content": "x"}] * 10)


@pytest.mark.parametrize(
    "source",
    ["{{ messages[0]['content'] + 1 }}", "{{ messages[5]['content'].upper() }}", "{{ 1 / 0 }}"],
)
def test_template_failures_become_chat_template_errors(source: str) -> None:
    template = ChatTemplate.from_string(source)
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_ordinary_operations_are_unchanged_by_the_bounds() -> None:
    template = ChatTemplate.from_string(
        "{{ 'ab' + 'cd' }} {{ 'x' * 3 }} {{ [1] + [2] }} {{ 2 ** 10 }} {{ '%03d' % 7 }} "
        "{{ range(3) | list }} {{ 7 % 3 }}"
    )
    assert template.render([]) == "abcd xxx [1, 2] 1024 007 [0, 1, 2] 1"


def test_renders_in_threads_keep_their_own_budgets() -> None:
    # The budget lives in a context variable: a render in another thread that
    # goes past its bound does not fail this one.
    small = ChatTemplate.from_string("{% for i in range(200) %}.{% endfor %}", max_range_items=100)
    big = ChatTemplate.from_string("{% for i in range(200) %}.{% endfor %}")
    errors: list[BaseException] = []
    results: list[str] = []

    def run_small() -> None:
        try:
            small.render([])
        except ChatTemplateError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_small)
    thread.start()
    results.append(big.render([]))
    thread.join()
    assert results == ["." * 200]
    assert len(errors) == 1
