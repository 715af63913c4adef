"""The chat page at ``/`` (issue 21): content negotiation, the page's headers, the
same-origin rule, and the page itself in headless Chromium.

The HTTP and handshake tests run the real server (:class:`~trioserve.server.Server`)
on the scripted engine over loopback. The browser tests load the page from
``python -m trioserve`` on the embedded model, as a person would, and check what
the DOM shows; the XSS test uses the scripted engine, whose completion is exactly
the markup the test chose. Browser tests skip, saying why, where no Chromium is
installed (tests/browser.py).

``TRIOSERVE_UPDATE_SCREENSHOT=1`` makes the chat test write its screenshot to
docs/chat-page.png (README.md shows it); commit it when it changes.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import socket
import struct
import tomllib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import h11
import pytest
import trio

from tests.browser import Page, chromium_or_skip, open_browser
from tests.helpers import ScriptedEngine, serving
from tests.serverproc import ServerProcess, open_server_process
from trioserve._version import __version__
from trioserve.server.accept import prefers_html
from trioserve.server.http_types import AccessPolicy, RequestHead
from trioserve.server.origin import parse_host, parse_origin, same_origin

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "chat-page.png"
STATIC = ROOT / "trioserve" / "static"
CHROME_ACCEPT = (
    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,"
    "image/apng,*/*;q=0.8,application/signed-exchange;v=b3;q=0.7"
)
FIREFOX_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
#: The scripted engine answers "say:X" with exactly X: this template puts the last
#: message after "say:", so a chat's answer is what the test typed.
SAY_TEMPLATE = (
    "{% for m in messages %}{% if loop.last %}say:{{ m['content'] }}{% endif %}{% endfor %}"
)


# --------------------------------------------------------------------------
# Content negotiation


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (CHROME_ACCEPT, True),
        (FIREFOX_ACCEPT, True),
        ("text/html", True),
        ("text/*", True),
        ("text/html;q=0.9, application/json;q=0.8", True),
        (None, False),  # curl -H 'Accept:', many libraries
        ("", False),
        ("*/*", False),  # curl, requests, httpx, the openai SDK
        ("application/json", False),
        ("application/json, text/html", False),  # a tie keeps the JSON
        ("text/html;q=0.5, application/*", False),
        ("text/html;q=0", False),
        ("text/html;q=nan", False),
        ("text/html;q=2", False),
        ("text/plain, */*;q=0.1", False),
        ("garbage,,;;/", False),
        ("text/html;q=0.1," * 10_000 + "application/json;q=1", True),  # read up to a bound
    ],
)
def test_only_clients_that_prefer_html_get_the_page(accept: str | None, html: bool) -> None:
    assert prefers_html(accept) is html


# --------------------------------------------------------------------------
# The same-origin rule


@pytest.mark.parametrize(
    ("origin", "host", "names", "same"),
    [
        # The server's own address, any port.
        ("http://127.0.0.1:7862", "127.0.0.1:7862", False, True),
        ("http://192.0.2.7:7862", "192.0.2.7:7862", False, True),
        ("http://[2001:db8::7]:7862", "[2001:db8::7]:7862", False, True),
        ("http://[2001:db8:0:0::7]:7862", "[2001:DB8::7]:7862", False, True),
        ("http://localhost:7862", "localhost:7862", False, True),
        ("HTTP://LOCALHOST:7862", "LocalHost:7862", False, True),
        # Default ports: a Host without one means the origin scheme's default.
        ("http://192.0.2.7", "192.0.2.7", False, True),
        ("http://192.0.2.7", "192.0.2.7:80", False, True),
        ("http://192.0.2.7:80", "192.0.2.7", False, True),
        ("https://192.0.2.7", "192.0.2.7", False, True),  # behind a TLS proxy on 443
        ("https://192.0.2.7", "192.0.2.7:443", False, True),
        ("https://192.0.2.7", "192.0.2.7:80", False, False),
        ("http://192.0.2.7", "192.0.2.7:443", False, False),
        ("https://192.0.2.7:8443", "192.0.2.7", False, False),
        ("https://192.0.2.7:8443", "192.0.2.7:8443", False, True),
        # Host names: only when a key is required (DNS rebinding).
        ("https://chat.example.org", "chat.example.org", True, True),
        ("https://chat.example.org", "chat.example.org", False, False),
        ("http://rebound.example:7862", "rebound.example:7862", False, False),
        ("http://rebound.example:7862", "rebound.example:7862", True, True),
        # Another site, another port, another host.
        ("https://evil.example", "chat.example.org", True, False),
        ("http://127.0.0.1:8000", "127.0.0.1:7862", True, False),
        ("http://127.0.0.2:7862", "127.0.0.1:7862", True, False),
        ("http://chat.example.org.evil.example", "chat.example.org", True, False),
        ("http://chat.example.org", "chat.example.org.evil.example", True, False),
        # Not an origin, or not a host.
        ("null", "127.0.0.1:7862", True, False),
        ("file://", "127.0.0.1:7862", True, False),
        ("ws://127.0.0.1:7862", "127.0.0.1:7862", True, False),
        ("http://127.0.0.1:7862/", "127.0.0.1:7862", True, False),
        ("http://127.0.0.1:7862/path", "127.0.0.1:7862", True, False),
        ("http://user@127.0.0.1:7862", "user@127.0.0.1:7862", True, False),
        ("http://127.0.0.1:7862", "", True, False),
        ("http://127.0.0.1:7862", "127.0.0.1:7862, evil.example", True, False),
        ("http://127.0.0.1:7862", "127.0.0.1:07862x", True, False),
        ("http://127.0.0.1:0", "127.0.0.1:0", True, False),
        ("http://127.0.0.1:99999", "127.0.0.1:99999", True, False),
        ("http://[::1", "[::1", True, False),
        ("http://[zz::1]:80", "[zz::1]:80", True, False),
        ("http://" + "a" * 300, "a" * 300, True, False),
        ("http://exa mple.org", "exa mple.org", True, False),
    ],
)
def test_same_origin(origin: str, host: str, names: bool, same: bool) -> None:
    assert same_origin(origin, host, names=names) is same


def test_hostile_hosts_and_origins_are_bounded_before_parsing() -> None:
    assert parse_host("a" * 10_000_000) is None
    assert parse_origin("http://" + "a" * 10_000_000) is None
    assert parse_host("[" + ":" * 100_000 + "]") is None
    assert parse_origin("https://[::1]:8443") == ("https", "[::1]", 8443)
    assert parse_host("Example.ORG:80") == ("example.org", 80)


def test_a_request_with_two_hosts_is_never_same_origin() -> None:
    def head(*hosts: bytes) -> RequestHead:
        headers = tuple((b"host", h) for h in hosts)
        return RequestHead("GET", "/", "/", "", headers, "1.1", "127.0.0.1:5000")

    policy = AccessPolicy(api_key="k")
    origin = "https://chat.example.org"
    assert policy.same_origin(head(b"chat.example.org"), origin)
    assert not policy.same_origin(head(b"chat.example.org", b"chat.example.org"), origin)
    assert not policy.same_origin(head(), origin)
    assert policy.check_origin(head(b"chat.example.org", b"evil.example")) is None  # no Origin


def test_the_own_origin_is_accepted_without_the_loopback_default() -> None:
    """``--allowed-origin none`` removes other loopback ports, not the server's own."""
    policy = AccessPolicy(allow_loopback_origins=False)

    def head(origin: bytes) -> RequestHead:
        headers = ((b"host", b"127.0.0.1:7862"), (b"origin", origin))
        return RequestHead("GET", "/", "/", "", headers, "1.1", "127.0.0.1:5000")

    assert policy.check_origin(head(b"http://127.0.0.1:7862")) is None
    refused = policy.check_origin(head(b"http://127.0.0.1:5173"))
    assert refused is not None and refused.status == 403


def test_only_a_plain_get_or_head_of_the_page_is_public() -> None:
    def head(method: str = "GET", path: str = "/", *extra: tuple[bytes, bytes]) -> RequestHead:
        headers = ((b"accept", CHROME_ACCEPT.encode()), *extra)
        return RequestHead(method, path, path, "", headers, "1.1", "127.0.0.1:5000")

    policy = AccessPolicy(api_key="k")
    assert policy.authorized(head()) and policy.authorized(head("HEAD"))
    assert not policy.authorized(head("POST"))
    assert not policy.authorized(head("GET", "/metrics"))
    for upgrade in (b"websocket", b"h2c"):
        assert not policy.authorized(head("GET", "/", (b"upgrade", upgrade)), allow_query=True)


def test_the_page_files_are_package_data() -> None:
    """Every file of trioserve/static is matched by pyproject's package data, so that
    an installed (not editable) trioserve serves the page too."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["trioserve.static"]
    files = [p.name for p in STATIC.iterdir() if p.is_file() and p.suffix != ".py"]
    assert sorted(files) == ["chat.css", "chat.html", "chat.js"]
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


# --------------------------------------------------------------------------
# Over a real socket: the page's headers, the JSON, keys and origins


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def http(
    port: int, method: str = "GET", path: str = "/", headers: Mapping[str, str] | None = None
) -> Reply:
    """One request with exactly ``headers`` (``Host`` included: give it)."""
    client = h11.Connection(h11.CLIENT)
    all_headers = {"Host": f"127.0.0.1:{port}", "Connection": "close", **(headers or {})}
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        data = client.send(
            h11.Request(method=method, target=path, headers=list(all_headers.items()))
        )
        await stream.send_all((data or b"") + (client.send(h11.EndOfMessage()) or b""))
        status, found, body = 0, {}, b""
        with trio.fail_after(30):
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    found = {k.decode(): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return Reply(status, found, body)


async def handshake(port: int, headers: dict[str, str]) -> int:
    """The status a WebSocket upgrade with ``headers`` gets (101: accepted)."""
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        "GET /?x=1 HTTP/1.1",
        *(f"{k}: {v}" for k, v in headers.items()),
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        head = b""
        with trio.fail_after(30):
            while b"\r\n" not in head:
                data = await stream.receive_some(4096)
                assert data, "the server closed without answering"
                head += data
    return int(head.split(b" ", 2)[1])


def parts(body: bytes) -> dict[str, str]:
    """The inline style and script of the page."""
    html = body.decode("utf-8")
    found = {}
    for tag in ("style", "script"):
        matches = re.findall(rf"<{tag}([^>]*)>(.*?)</{tag}>", html, re.DOTALL)
        assert len(matches) == 1, f"expected one <{tag}>"
        attributes, text = matches[0]
        assert attributes == "", f"<{tag}{attributes}>: no src, no attributes"
        found[tag] = text
    return found


def csp_hash(text: str) -> str:
    digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
    return f"'sha256-{digest}'"


async def test_the_page_is_one_self_contained_document_with_a_strict_policy() -> None:
    async with serving(ScriptedEngine()) as (_, listening):
        reply = await http(listening.port, headers={"Accept": CHROME_ACCEPT})
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/html; charset=utf-8"
    html = reply.body.decode("utf-8")
    assert html.startswith("<!doctype html>")
    inline = parts(reply.body)
    # Package data as shipped: the three files, put together.
    assert inline["style"] == (STATIC / "chat.css").read_text()
    assert inline["script"] == (STATIC / "chat.js").read_text()
    # Nothing from elsewhere: every URL in the markup is a data: URL.
    markup = html.replace(inline["style"], "").replace(inline["script"], "")
    urls = re.findall(r"""\s(?:src|href|action)\s*=\s*["']?([^"'\s>]*)""", markup)
    assert urls == ["data:,"]  # the icon: none, without asking the server for one
    assert "@import" not in inline["style"] and "url(" not in inline["style"]

    policy = dict(
        [*d.split(" ", 1), ""][:2] for d in reply.headers["content-security-policy"].split("; ")
    )
    assert policy == {
        "default-src": "'none'",
        "script-src": csp_hash(inline["script"]),
        "style-src": csp_hash(inline["style"]),
        "connect-src": "'self'",
        "img-src": "data:",
        "base-uri": "'none'",
        "form-action": "'none'",
        "frame-ancestors": "'none'",
    }
    assert reply.headers["cache-control"] == "no-cache"
    assert re.fullmatch(r'"[0-9a-f]{32}"', reply.headers["etag"])
    assert reply.headers["vary"] == "Accept"
    assert reply.headers["x-content-type-options"] == "nosniff"
    assert reply.headers["referrer-policy"] == "no-referrer"


def test_the_script_never_writes_markup() -> None:
    """Model output is text: the page's script has no way to write markup."""
    script = (STATIC / "chat.js").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.strip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in code, sink
    assert "new Function" not in code and "DOMParser" not in code


async def test_head_and_revalidation_as_for_a_static_file() -> None:
    async with serving(ScriptedEngine()) as (_, listening):
        port = listening.port
        page = await http(port, headers={"Accept": "text/html"})
        head = await http(port, "HEAD", headers={"Accept": "text/html"})
        assert (head.status, head.body) == (200, b"")
        assert head.headers["content-length"] == str(len(page.body))
        assert head.headers["etag"] == page.headers["etag"]
        etag = page.headers["etag"]
        for condition in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            same = await http(port, headers={"Accept": "text/html", "If-None-Match": condition})
            assert (same.status, same.body) == (304, b""), condition
            assert same.headers["etag"] == etag
        changed = await http(port, headers={"Accept": "text/html", "If-None-Match": '"other"'})
        assert changed.status == 200 and changed.body == page.body


async def test_the_json_answer_for_other_clients_is_unchanged() -> None:
    expected = {
        "name": "trioserve",
        "version": __version__,
        "model": "scripted-bytes",
        "engine": "scripted",
        "websocket": "/ (the ExLlamaV2 WebSocket protocol: docs/protocol.md)",
        "openai": "/v1 (models, completions, chat/completions: docs/openai.md;"
        " responses: docs/responses.md)",
        "anthropic": "/v1/messages, /v1/messages/count_tokens (docs/anthropic.md)",
        "tokenizer": "/tokenize, /detokenize, /tokenizer_info (vLLM's: docs/openai.md)",
        "sglang": "/model_info, /server_info (for SGLang's Model Gateway: docs/scale-out.md)",
        "health": "/health",
        "ready": "/ready",
        "metrics": "/metrics",
        "docs": "the docs/ folder of trioserve: quickstart.md, deployment.md",
    }
    async with serving(ScriptedEngine()) as (_, listening):
        for accept in (None, "*/*", "application/json", "application/json, text/html"):
            headers = {} if accept is None else {"Accept": accept}
            reply = await http(listening.port, headers=headers)
            assert reply.status == 200, accept
            assert reply.headers["content-type"] == "application/json", accept
            assert json.loads(reply.body) == expected, accept
            # Caches must not hand the page to a client that asked for JSON.
            assert reply.headers["vary"] == "Accept"


async def test_the_page_needs_no_key_and_the_json_still_does() -> None:
    key = "k3y"
    bearer = {"Authorization": f"Bearer {key}"}
    async with serving(ScriptedEngine(), api_key=key) as (_, listening):
        port = listening.port
        page = await http(port, headers={"Accept": CHROME_ACCEPT})
        assert page.status == 200 and b"<!doctype html>" in page.body
        assert (await http(port, "HEAD", headers={"Accept": CHROME_ACCEPT})).status == 200
        assert (await http(port)).status == 401
        assert (await http(port, headers={"Accept": "application/json"})).status == 401
        assert (await http(port, headers={"Accept": "*/*", **bearer})).status == 200
        # Only the page: other routes want the key whatever the client accepts.
        for path in ("/metrics", "/v1/models", "/index.html"):
            refused = await http(port, path=path, headers={"Accept": CHROME_ACCEPT})
            assert refused.status == 401, path
        assert (await http(port, "POST", headers={"Accept": CHROME_ACCEPT})).status == 401
        # The WebSocket handshake still needs the key, from a page too, and
        # whatever it says it accepts.
        origin = {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"}
        assert await handshake(port, origin) == 401
        assert await handshake(port, {**origin, "Accept": CHROME_ACCEPT}) == 401
        assert await handshake(port, {**origin, "Accept": CHROME_ACCEPT, **bearer}) == 101


async def test_the_page_origin_is_accepted_and_a_foreign_one_refused() -> None:
    """What a browser sends when the page was loaded from the server's LAN address
    (an IP literal: accepted without a key), from a host name (accepted when a key is
    required), or when another site, or a DNS-rebinding one, tries."""
    async with serving(ScriptedEngine()) as (_, listening):
        port = listening.port
        lan = {"Host": f"192.0.2.7:{port}", "Origin": f"http://192.0.2.7:{port}"}
        assert await handshake(port, lan) == 101
        assert (await http(port, "POST", "/v1/completions", headers=lan)).status != 403
        v6 = {"Host": f"[2001:db8::7]:{port}", "Origin": f"http://[2001:db8::7]:{port}"}
        assert await handshake(port, v6) == 101
        for origin in (
            "https://evil.example",
            f"http://192.0.2.8:{port}",  # another host
            "http://192.0.2.7:8000",  # another port of the same host
            "null",
        ):
            foreign = {"Host": f"192.0.2.7:{port}", "Origin": origin}
            assert await handshake(port, foreign) == 403, origin
            refused = await http(port, "GET", "/health", headers=foreign)
            assert refused.status == 403, origin
            assert json.loads(refused.body)["error"]["code"] == "origin_not_allowed"
        # DNS rebinding: evil.example now resolves to this server. Same host and
        # port in both headers, but a name, and no key: refused.
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        assert await handshake(port, rebound) == 403
        assert (await http(port, "GET", "/health", headers=rebound)).status == 403

    key = "k3y"
    async with serving(ScriptedEngine(), api_key=key) as (_, listening):
        port = listening.port
        # Behind nginx on 443: the browser's origin is https://chat.example.org, the
        # server sees plain HTTP and the Host nginx forwards.
        proxied = {"Host": "chat.example.org", "Origin": "https://chat.example.org"}
        assert await handshake(port, {**proxied, "Authorization": f"Bearer {key}"}) == 101
        assert await handshake(port, proxied) == 401  # the origin passes; the key is missing
        for origin in ("https://evil.example", "https://chat.example.org:8443"):
            foreign = {"Host": "chat.example.org", "Origin": origin}
            assert await handshake(port, {**foreign, "Authorization": f"Bearer {key}"}) == 403
            assert (await http(port, "GET", "/health", headers=foreign)).status == 403


# --------------------------------------------------------------------------
# In the browser


@pytest.fixture
def chromium() -> str:
    """The Chromium to drive; skips the test, saying why, where there is none."""
    return chromium_or_skip()


STATUS_OPEN = "document.getElementById('status').dataset.state === 'open'"
LAST_TEXT = "(document.querySelector('#log .turn.assistant:last-child .text') || {}).textContent"
LAST_STATS = "!!document.querySelector('#log .turn.assistant:last-child .stats')"


async def set_field(page: Page, field: str, value: str) -> None:
    """Set a settings field as a person would (its change event saves it)."""
    await page.evaluate(
        f"(() => {{ const f = document.getElementById({json.dumps(field)});"
        f" f.value = {json.dumps(value)}; f.dispatchEvent(new Event('change')); }})()"
    )


async def stats(page: Page) -> dict[str, str]:
    value = await page.evaluate(
        "Object.fromEntries([...document.querySelectorAll("
        "'#log .turn.assistant:last-child .stats [data-stat]')]"
        ".map((s) => [s.dataset.stat, s.textContent]))"
    )
    assert isinstance(value, dict)
    return value


async def watch_growth(page: Page) -> None:
    """Record the length of the last answer at each change of its text."""
    await page.evaluate(
        "window.__growth = []; new MutationObserver(() => window.__growth.push("
        f"({LAST_TEXT} || '').length)).observe(document.getElementById('log'),"
        " {subtree: true, childList: true, characterData: true})"
    )


async def send(page: Page, text: str) -> None:
    await page.type_text("#input", text)
    await page.press_enter()


def logged(server: ServerProcess, request_id: str, after: int = 0) -> dict[str, str]:
    """The access-log fields of ``request_id``'s ``infer`` (the last one logged)."""
    for line in reversed(server.log[after:]):
        if "infer done" in line and f" request_id={request_id} " in line:
            return dict(re.findall(r"(\w+)=(\S+)", line))
    raise AssertionError(f"no access log line for {request_id}: {server.log[-5:]}")


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


#: The embedded model on a small context, one torch thread: the machine is shared.
MODEL_ARGS = ("--context-length", "1024", "--threads", "1")


@pytest.mark.slow
async def test_chat_stop_and_new_chat_in_chromium(chromium: str) -> None:
    """A person's first session: send a message and watch it stream, read the
    statistics, stop a long answer, reload for a new chat."""
    async with open_browser(chromium) as browser, open_server_process(MODEL_ARGS) as server:
        page = await browser.new_page()
        url = f"http://127.0.0.1:{server.port}/"
        await page.goto(url)
        await page.wait_for(STATUS_OPEN, what="the WebSocket to open")
        model = await page.wait_for("document.getElementById('model').textContent.trim()")
        assert model == "SmolLM2-135M-Instruct · cpu · context 1024 tokens"

        # 1. A message, streamed; its statistics from the final frame.
        await set_field(page, "temperature", "0")
        await set_field(page, "max_new_tokens", "40")
        await watch_growth(page)
        await send(page, "What is the capital of France?")
        assert await page.evaluate("document.getElementById('input').value") == ""
        assert await page.evaluate("document.getElementById('stop').disabled") is False
        await page.wait_for(LAST_STATS, within=300, what="the first answer's final frame")
        answer = await page.evaluate(LAST_TEXT)
        growth = await page.evaluate("window.__growth")
        assert answer and "Paris" in answer
        lengths = sorted({n for n in growth if n})
        assert len(lengths) >= 3, f"the answer did not grow token by token: {growth}"
        assert lengths[-1] == len(answer)  # the chunks made the whole answer
        shown = await stats(page)
        access = logged(server, "chat-1")
        assert shown["generated"] == f"{access['generated_tokens']} tokens"
        assert shown["prompt"] == f"prompt {access['prompt_tokens']} tokens"
        assert shown["cached"] == f"{access['cached_tokens']} cached"
        assert shown["stop"] in ("end of turn", "stopped at max_new_tokens")
        assert re.fullmatch(r"\d+\.\d tok/s", shown["tps"]), shown
        assert re.fullmatch(r"first token \d+\.\d\d s", shown["ttft"]), shown
        assert await page.evaluate("document.getElementById('stop').disabled") is True

        # 2. A long answer, stopped: it ends as interrupted, with what it had.
        await set_field(page, "max_new_tokens", "600")
        await send(page, "Write a long story about a dragon who learns to fly.")
        await page.wait_for(f"({LAST_TEXT} || '').length > 150", within=300, what="the story")
        await page.click("#stop")
        await page.wait_for(LAST_STATS, within=120, what="the stopped answer's final frame")
        shown = await stats(page)
        assert shown["stop"] == "interrupted"
        assert await page.evaluate(
            "document.querySelector('#log .turn.assistant:last-child')"
            ".classList.contains('interrupted')"
        )
        stopped = logged(server, "chat-2")
        assert stopped["stop_reason"] == "interrupted"
        assert int(stopped["generated_tokens"]) < 600
        # The second turn carried the first: its prompt is the longer.
        assert int(stopped["prompt_tokens"]) > int(access["prompt_tokens"])

        shot = await page.screenshot()
        assert png_size(shot) == (1280, 800)
        if os.environ.get("TRIOSERVE_UPDATE_SCREENSHOT") == "1":
            SCREENSHOT.write_bytes(shot)

        # 3. Reload: a new chat (the settings stay, in localStorage).
        await page.reload()
        await page.wait_for(STATUS_OPEN, what="the WebSocket to open after the reload")
        assert await page.evaluate("document.getElementById('log').children.length") == 0
        assert await page.evaluate("document.getElementById('max_new_tokens').value") == "600"
        await set_field(page, "max_new_tokens", "4")
        mark = len(server.log)
        await send(page, "Hi")
        await page.wait_for(LAST_STATS, within=300, what="the new chat's answer")
        fresh = logged(server, "chat-1", after=mark)
        assert int(fresh["prompt_tokens"]) < int(access["prompt_tokens"]), "not a new chat"

        # 4. The New chat button clears the page too.
        await page.click("#new-chat")
        assert await page.evaluate("document.getElementById('log').children.length") == 0
        assert page.errors == []


class _TemplatedEngine(ScriptedEngine):
    """The scripted engine with a model directory holding a chat template."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        (model_dir / "chat_template.jinja").write_text(SAY_TEMPLATE)
        self._info = attrs.evolve(self._info, model_dir=str(model_dir))


XSS = (
    '<img src=x onerror="window.__xss = 1"><script>window.__xss = 2</script>'
    '<b>bold</b> &lt;escaped&gt; <a href="javascript:window.__xss=3">link</a>'
)


async def test_model_output_is_text_never_markup(chromium: str, tmp_path: Path) -> None:
    """A completion made of markup is shown as that text: no element of it reaches
    the DOM, and none of its handlers runs."""
    engine = _TemplatedEngine(tmp_path)
    async with open_browser(chromium) as browser, serving(engine) as (_, listening):
        page = await browser.new_page()
        await page.goto(f"http://127.0.0.1:{listening.port}/")
        await page.wait_for(STATUS_OPEN, what="the WebSocket to open")
        await set_field(page, "max_new_tokens", "1000")
        await page.evaluate(f"document.getElementById('input').value = {json.dumps(XSS)}")
        await page.click("#send")
        await page.wait_for(LAST_STATS, what="the final frame")
        assert await page.evaluate(LAST_TEXT) == XSS
        assert (
            await page.evaluate("document.querySelector('#log .turn.user .text').textContent")
            == XSS
        )
        found = await page.evaluate(
            "document.querySelectorAll('#log img, #log script, #log b, #log a').length"
        )
        assert found == 0
        assert await page.evaluate("document.querySelectorAll('img, a').length") == 0
        assert await page.evaluate("document.scripts.length") == 1  # the page's own
        assert await page.evaluate("window.__xss") is None
        assert (await stats(page))["stop"] == "end of turn"
        assert page.errors == []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@asynccontextmanager
async def model_server(port: int, key: str) -> AsyncIterator[ServerProcess]:
    async with open_server_process(
        (*MODEL_ARGS, "--port", str(port)), env={"TRIOSERVE_API_KEY": key}
    ) as server:
        yield server


NOTICE = "document.getElementById('notice').textContent"


@pytest.mark.slow
async def test_api_key_prompt_and_reconnect_after_a_restart(chromium: str) -> None:
    """With --api-key the page asks for the key and says when it is wrong; a server
    that dies mid-answer and comes back loses nothing the person typed."""
    key = "k&y +=%/1"  # every character that a query string would change
    port = free_port()
    async with open_browser(chromium) as browser:
        page = await browser.new_page()
        async with model_server(port, key) as server:
            await page.goto(f"http://127.0.0.1:{port}/")
            await page.wait_for(
                "!document.getElementById('key-form').hidden", what="the key prompt"
            )
            assert await page.evaluate(NOTICE) == "This server needs an API key."

            await page.type_text("#key", "wrong")
            await page.click("#key-form button")
            await page.wait_for(f"{NOTICE}.includes('refused this API key')", what="the refusal")
            assert await page.evaluate("!document.getElementById('key-form').hidden")

            await page.type_text("#key", key)
            await page.click("#key-form button")
            await page.wait_for(STATUS_OPEN, what="the WebSocket to open with the key")
            assert await page.evaluate("document.getElementById('key-form').hidden")

            # The server dies in the middle of an answer.
            await set_field(page, "max_new_tokens", "600")
            message = "Write a long story about a lighthouse keeper."
            await send(page, message)
            await page.wait_for(f"({LAST_TEXT} || '').length > 5", within=300, what="the story")
            server.process.kill()
            await server.process.wait()

        await page.wait_for(
            "!!document.querySelector('#log .turn.assistant:last-child .error')",
            what="the lost answer to be marked",
        )
        assert await page.evaluate("document.getElementById('input').value") == message
        assert await page.evaluate("document.getElementById('status').dataset.state") != "open"
        # Sent while the server is down: kept in the box, with a word about it.
        await page.press_enter()
        kept = "Your message is kept, and sent when the connection is back."
        await page.wait_for(f"{NOTICE}.includes({kept!r})", what="the word about it")
        assert await page.evaluate("document.getElementById('input').value") == message
        await page.wait_for(
            f"{NOTICE}.startsWith('The server does not answer') && {NOTICE}.includes({kept!r})",
            what="the server to be missed",
        )

        async with model_server(port, key) as server:
            # The page reconnects by itself, with the key, and sends what was kept.
            await page.wait_for(STATUS_OPEN, within=60, what="the page to reconnect")
            await page.wait_for(
                "document.querySelectorAll('#log .turn.user').length === 2", what="the resend"
            )
            assert await page.evaluate("document.getElementById('input').value") == ""
            await page.click("#stop")
            await page.wait_for(LAST_STATS, within=120, what="the resent answer to end")
            assert logged(server, "chat-2")["stop_reason"] == "interrupted"
        assert page.errors == []
