"""trioserve.logs: the text and JSON formats, structured fields, redaction and
startup phases, through real loggers and a real handler."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from trioserve.logs import (
    REDACTED,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    phase,
    record_fields,
)

pytestmark = pytest.mark.unit

ACCESS = {
    "peer": "127.0.0.1:50312",
    "request_id": "q 1",
    "action": "infer",
    "prompt_tokens": 16,
    "generated_tokens": 8,
    "queue_s": 0.000125,
    "ttft_s": 0.25,
    "tok_s": 31.5,
    "stop_reason": "eos",
    "error_type": None,
}


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """The root logger writing into a string, put back as it was after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    yield out
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_json_lines_carry_the_core_keys_and_the_fields(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    access = logging.getLogger("trioserve.access")
    access.info("infer finished", extra={"fields": ACCESS})
    access.debug("not at info")
    logging.getLogger("trioserve.server").warning("plain %s", "message")
    first, second = (json.loads(line) for line in lines(stream))
    assert first == {
        "time": first["time"],
        "level": "info",
        "logger": "trioserve.access",
        "message": "infer finished",
        **ACCESS,
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert second["message"] == "plain message"
    assert second["level"] == "warning"
    assert set(second) == {"time", "level", "logger", "message"}


def test_json_survives_what_json_cannot_hold(stream: io.StringIO) -> None:
    configure_logging("debug", "json", stream=stream)
    log = logging.getLogger("trioserve.test")
    weird = {
        "nan": float("nan"),
        "inf": float("inf"),
        "obj": object(),
        "bytes": b"\xff",
        "nested": {"list": [1, float("-inf")]},
        "text": 'line\nbreak "quoted" \u2028 日本',
        # A field may not replace a core key.
        "message": "spoofed",
        "level": "critical",
    }
    log.info("odd values", extra={"fields": weird})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in lines(stream))
    assert (first["nan"], first["inf"]) == ("nan", "inf")
    assert first["nested"] == {"list": [1, "-inf"]}
    assert first["text"] == weird["text"]
    assert isinstance(first["obj"], str)
    assert (first["message"], first["level"]) == ("odd values", "info")
    assert (first["field.message"], first["field.level"]) == ("spoofed", "critical")
    assert second["level"] == "error"
    assert "ValueError: boom" in second["exception"]
    assert "Traceback" in second["exception"]


def test_text_appends_key_value_pairs_that_split_back(stream: io.StringIO) -> None:
    configure_logging("info", "text", stream=stream)
    logging.getLogger("trioserve.access").info("infer finished", extra={"fields": ACCESS})
    (line,) = lines(stream)
    head, _, pairs = line.partition("trioserve.access: infer finished ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ", head)
    # A value with a space is quoted; None is "-"; numbers are bare.
    found = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', pairs))
    assert found == {
        "peer": "127.0.0.1:50312",
        "request_id": '"q 1"',
        "action": "infer",
        "prompt_tokens": "16",
        "generated_tokens": "8",
        "queue_s": "0.000125",
        "ttft_s": "0.25",
        "tok_s": "31.5",
        "stop_reason": "eos",
        "error_type": "-",
    }
    assert json.loads(found["request_id"]) == "q 1"


def test_text_keeps_a_line_a_record_whatever_a_value_holds(stream: io.StringIO) -> None:
    configure_logging("info", "text", stream=stream)
    log = logging.getLogger("trioserve.test")
    fields = {"peer": "x\ny=1", "q": 'a"b', "eq": "k=v", "sep": "a\u2028b\x85"}
    log.info("one", extra={"fields": fields})
    (line,) = lines(stream)
    assert line.endswith(' peer="x\\ny=1" q="a\\"b" eq="k=v" sep="a\\u2028b\\u0085"')


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_keys_are_redacted_in_both_formats(stream: io.StringIO, log_format: str) -> None:
    configure_logging("info", log_format, stream=stream)  # type: ignore[arg-type]
    secret = "sk-do-not-print-4f1c"
    fields = {"api_key": secret, "Authorization": f"Bearer {secret}", "peer": "127.0.0.1:1"}
    logging.getLogger("trioserve.server").info("rejected", extra={"fields": fields})
    text = stream.getvalue()
    assert secret not in text
    assert REDACTED in text
    assert "127.0.0.1:1" in text


def test_fields_that_are_not_a_mapping_are_ignored() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert record_fields(record) == {}
    record.fields = ["not", "a", "dict"]
    assert record_fields(record) == {}
    assert TextFormatter().format(record).endswith("x: m")
    assert set(json.loads(JsonFormatter().format(record))) == {"time", "level", "logger", "message"}


def test_configure_twice_writes_each_line_once(stream: io.StringIO) -> None:
    configure_logging("info", "text", stream=io.StringIO())
    configure_logging("warning", "text", stream=stream)
    log = logging.getLogger("trioserve.test")
    log.info("hidden")
    log.warning("shown")
    assert len(lines(stream)) == 1
    assert lines(stream)[0].endswith("WARNING trioserve.test: shown")
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml", stream=stream)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log level"):
        configure_logging("loud", "text", stream=stream)


def test_phase_logs_its_start_and_its_duration(stream: io.StringIO) -> None:
    configure_logging("info", "json", stream=stream)
    with phase("load", "loading the model", engine="cpu") as fields:
        fields["model"] = "m"
    with pytest.raises(RuntimeError), phase("model", "obtaining the model"):
        raise RuntimeError("no model")
    start, end, failed = (json.loads(line) for line in lines(stream))
    assert start["message"] == "loading the model ..."
    assert (start["phase"], start["engine"]) == ("load", "cpu")
    assert re.fullmatch(r"loading the model: done in \d+\.\d s", end["message"])
    assert (end["phase"], end["engine"], end["model"]) == ("load", "cpu", "m")
    assert end["duration_s"] >= 0
    # A failed phase logs its start only: whoever catches the error reports it.
    assert failed["message"] == "obtaining the model ..."
