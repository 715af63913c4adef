"""Numbers the docs take from defaults are the declared defaults.

Each row names a document, the sentence (whitespace-normalised) that states
a default, and where the code declares it; a default that changes without
its docs fails here. deployment.md's option table is checked column by
column against trioserve.cli.OPTIONS.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from trioserve import protocol as p
from trioserve.cli import OPTIONS
from trioserve.openai.fields import OpenAILimits
from trioserve.server import ServerConfig
from trioserve.server.http_types import HTTPLimits
from trioserve.server.server import default_max_message_bytes

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
KiB = 1024
MiB = 1024 * KiB

C = ServerConfig()
H = HTTPLimits()
L = p.FIELD_LIMITS


def doc(name: str) -> str:
    """``name``'s text with every run of whitespace one space."""
    return " ".join((ROOT / name).read_text(encoding="utf-8").split())


#: (document, the sentence that states a default, built from the declaration).
SENTENCES: list[tuple[str, str]] = [
    # protocol.md, section 1
    (
        "docs/protocol.md",
        f"{C.max_requests_per_connection} `infer` requests in flight per connection",
    ),
    (
        "docs/protocol.md",
        f"{C.max_waiting_jobs} jobs waiting for the engine across all connections",
    ),
    (
        "docs/protocol.md",
        f"The server pings every {C.ping_interval:g} s and drops a connection that does not "
        f"answer within {C.ping_timeout:g} s",
    ),
    (
        "docs/protocol.md",
        "frames up to 16 bytes per token of the context, at least "
        f"{default_max_message_bytes(1) // KiB} KiB",
    ),
    ("docs/protocol.md", f"at most {L['max_id_bytes']:,} bytes (as compact JSON)"),
    ("docs/protocol.md", f"(any JSON value of at most {L['max_tag_bytes'] // KiB} KiB)"),
    ("docs/protocol.md", f"arrays and objects nested deeper than {L['max_json_depth']}"),
    ("docs/protocol.md", f"{L['max_stop_conditions']} x {L['max_stop_string_chars']} characters"),
    (
        "docs/protocol.md",
        f"{L['max_dry_sequence_breakers']} x {L['max_dry_sequence_breaker_chars']} characters",
    ),
    ("docs/protocol.md", f"OpenAI's chat API takes at most {L['max_messages']:,} messages"),
    # reliability.md
    ("docs/reliability.md", f"**JSON nesting: {L['max_json_depth']} levels.**"),
    ("docs/reliability.md", f"(`--prefill-share`, {0.5:g})"),
    ("docs/reliability.md", f"(`--max-requests-per-connection`, {C.max_requests_per_connection})"),
    ("docs/reliability.md", f"(`--max-requests-per-client`, {C.max_requests_per_client}:"),
    ("docs/reliability.md", f"(`--max-waiting-jobs`, {C.max_waiting_jobs})"),
    # http.md's limits table
    (
        "docs/http.md",
        f"| request head (line and headers) | {H.max_head_bytes // KiB} KiB | `431`, close |",
    ),
    (
        "docs/http.md",
        f"from a request's first byte) | {C.handshake_timeout:g} s | `408`, close (slowloris) |",
    ),
    ("docs/http.md", f"| idle keep-alive connection | {H.idle_timeout:g} s | closed quietly |"),
    ("docs/http.md", f"| time to send a body | {H.body_timeout:g} s | `408`, close |"),
    ("docs/http.md", f"| a write the client does not read | {C.send_timeout:g} s |"),
    ("docs/http.md", f"| requests per connection | {H.max_requests_per_connection} |"),
    (
        "docs/http.md",
        f"| open connections, both protocols | {C.max_connections} (`--max-connections`) |",
    ),
    (
        "docs/http.md",
        "16 bytes per token of context, at least "
        f"{default_max_message_bytes(1) // KiB} KiB (`--max-message-bytes`)",
    ),
    # openai.md
    ("docs/openai.md", f"a request head larger than {H.max_head_bytes // KiB} KiB"),
    # deployment.md and scale-out.md
    ("docs/deployment.md", f"for the default {C.shutdown_grace:g} s grace"),
    ("docs/scale-out.md", "(`--prefix-cache-mib`, 128 MiB by default)"),
]


@pytest.mark.parametrize(
    ("name", "sentence"), SENTENCES, ids=[f"{n}:{s[:40]}" for n, s in SENTENCES]
)
def test_the_doc_states_the_declared_default(name: str, sentence: str) -> None:
    assert sentence in doc(name)


def test_the_protocol_limits_table_is_field_limits() -> None:
    text = doc("docs/protocol.md")
    rows = re.findall(r"\| `(max_[a-z_]+)` \| (\d+) \|", text)
    assert dict((k, int(v)) for k, v in rows) == dict(L)


def test_the_openai_limits_are_the_protocol_s() -> None:
    # openai.md says both doors take the same bounds; OpenAILimits declares them.
    limits = OpenAILimits()
    assert limits.max_stop_strings == L["max_stop_conditions"]
    assert limits.max_stop_string_chars == L["max_stop_string_chars"]
    assert limits.max_banned_ids == L["max_banned_ids"]
    assert limits.max_messages == L["max_messages"]


def _render(value: Any, flag: str) -> str | None:
    """How deployment.md writes a default, or None for one it describes in
    words (None, on/off, lists)."""
    if value is None or isinstance(value, bool | tuple):
        return None
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int) and value >= MiB and value % MiB == 0:
        return f"{value // MiB} MiB"
    if isinstance(value, float) and re.search(r"timeout|interval|grace", flag):
        return f"{value:g} (seconds)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_the_deployment_option_table_shows_the_declared_defaults() -> None:
    rows = {
        cells[0].strip(" `"): cells[2].strip()
        for line in (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `--")
        for cells in [line.strip("|").split(" | ")]
    }
    checked = 0
    for option in OPTIONS:
        shown = _render(option.default_value(), option.flag)
        if shown is None:
            continue
        flag = option.flag
        key = next(k for k in rows if k.split("`")[0].strip() == flag)
        assert rows[key].strip("`") == shown.strip("`"), (flag, rows[key], shown)
        checked += 1
    assert checked >= 20


def test_the_systemd_stop_timeout_is_longer_than_the_grace() -> None:
    unit = (ROOT / "deploy" / "systemd" / "trioserve@.service").read_text(encoding="utf-8")
    found = re.search(r"^TimeoutStopSec=(\d+)s$", unit, flags=re.MULTILINE)
    assert found and f"the shipped unit gives {found.group(1)} s" in doc("docs/deployment.md")
    assert int(found.group(1)) > C.shutdown_grace


def test_the_kernel_paths_sum_16_outputs_at_once_where_performance_md_says() -> None:
    """docs/performance.md: AVX2 and NEON sum 16 outputs' lanes at once for
    one row only, AVX-512 for every row block (kernels.h's default)."""
    kernels = ROOT / "trioserve" / "engine" / "cpu"

    def declared(name: str) -> str | None:
        found = re.search(
            r"^#define SUM16_ROWS (\S+)", (kernels / name).read_text("utf-8"), re.MULTILINE
        )
        return found.group(1) if found else None

    for name in (
        "kernels_avx2.c",
        "kernels_avx2_vnni.c",
        "kernels_neon.c",
        "kernels_neon_dotprod.c",
    ):
        assert declared(name) == "1", name
    assert declared("kernels_avx512.c") is None
    assert re.search(
        r"^#define SUM16_ROWS Q4_ROWS$", (kernels / "kernels.h").read_text("utf-8"), re.MULTILINE
    )
    assert "so AVX2 and NEON use it for one row only" in doc("docs/performance.md")


def test_the_8bit_projections_constants_are_what_performance_md_says() -> None:
    """docs/performance.md, "The 8-bit projection in integers": the integer
    sums go to float32 every 512 inputs (kernels_arith.h's I8_CHUNK, which
    int8_layout.py's bound counts too), AVX2 takes 6 rows a pass, and the
    recheck looks at blocks of 64 columns (llama.py's _BLOCK). Read from the
    sources: this tier imports no torch."""
    cpu = ROOT / "trioserve" / "engine" / "cpu"

    def value(name: str, pattern: str) -> str:
        found = re.search(pattern, (cpu / name).read_text("utf-8"), re.MULTILINE)
        assert found, (name, pattern)
        return found.group(1)

    chunk = value("kernels_arith.h", r"^#define I8_CHUNK (\d+)")
    assert value("int8_layout.py", r"^CHUNK = (\d+)$") == chunk
    rows = value("kernels_avx2.c", r"^#define I8_ROWS (\d+)")
    assert value("kernels_avx2_vnni.c", r"^#define I8_ROWS (\d+)") == rows
    block = value("llama.py", r"^_BLOCK = (\d+)$")
    text = " ".join(doc("docs/performance.md").split())
    assert f"the integer sums go to float32 every {chunk} inputs" in text
    assert f"avx2 ({rows} rows a pass)" in text
    assert f"the maxima of blocks of {block} columns" in text
