"""Headless Chromium driven over the Chrome DevTools Protocol, for the chat page's tests.

No browser driver package: Chromium is started with ``--remote-debugging-port=0``,
writes the port it chose into ``DevToolsActivePort`` in its profile directory, and
is spoken to over one WebSocket (trio-websocket, which trioserve already needs),
one flat session per page. Chromium is Debian's ``chromium`` package
(``apt-get install chromium``), or the executable named by ``TRIOSERVE_CHROMIUM``;
:func:`chromium_or_skip` skips a test, saying why, where there is none.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio_websocket

__all__ = ["Browser", "BrowserError", "Page", "chromium_or_skip", "open_browser"]

_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: A 1280x800 PNG screenshot is well under this.
_MAX_MESSAGE = 64 * 1024 * 1024


class BrowserError(Exception):
    """A DevTools command failed, or the page threw."""


def find_chromium() -> str | None:
    explicit = os.environ.get("TRIOSERVE_CHROMIUM")
    if explicit:
        return explicit
    for name in _NAMES:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def chromium_or_skip() -> str:
    """The Chromium executable, or skip the calling test with the reason."""
    found = find_chromium()
    if found is None:
        pytest.skip(
            "no Chromium here for the chat page's browser tests: install Debian's "
            "'chromium' package (apt-get install chromium), or set TRIOSERVE_CHROMIUM "
            "to a Chromium or Chrome executable"
        )
    return found


@attrs.define(eq=False)
class Browser:
    """One Chromium process and its DevTools connection."""

    ws: trio_websocket.WebSocketConnection
    _ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    _waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)
    _pages: dict[str, Page] = attrs.Factory(dict)

    async def command(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """Send one DevTools command and wait for its result."""
        number = next(self._ids)
        message: dict[str, Any] = {"id": number, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[number] = send
        try:
            await self.ws.send_message(json.dumps(message))
            with trio.fail_after(60):
                reply = await receive.receive()
        finally:
            self._waiting.pop(number, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result = reply.get("result", {})
        assert isinstance(result, dict)
        return result

    async def read(self) -> None:
        """Deliver results to their commands and events to their pages."""
        while True:
            try:
                raw = await self.ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            message = json.loads(raw)
            if "id" in message:
                waiting = self._waiting.get(message["id"])
                if waiting is not None:
                    waiting.send_nowait(message)
            elif message.get("sessionId") in self._pages:
                self._pages[message["sessionId"]].event(message)

    async def new_page(self, width: int = 1280, height: int = 800) -> Page:
        target = await self.command("Target.createTarget", {"url": "about:blank"})
        attached = await self.command(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        self._pages[page.session] = page
        await page.command("Page.enable")
        await page.command("Runtime.enable")
        await page.command(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page


@attrs.define(eq=False)
class Page:
    """One tab. ``errors`` collects what its scripts threw and logged as errors."""

    browser: Browser
    session: str
    errors: list[str] = attrs.Factory(list)

    def event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params.get("exceptionDetails", {}))[:1000])
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(json.dumps(params.get("args", []))[:1000])

    async def command(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.command(method, params, self.session)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited when it is a promise)."""
        result = await self.command(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, within: float = 30.0, what: str = "") -> Any:
        """Poll ``expression`` until its value is truthy in Python; that value.
        (A DOM node comes back as ``{}``: test for it with ``!!``.)"""
        with trio.move_on_after(within):
            while True:
                value = await self.evaluate(expression)
                if value:
                    return value
                await trio.sleep(0.05)
        raise AssertionError(f"timed out after {within:g} s waiting for {what or expression}")

    async def goto(self, url: str) -> None:
        navigated = await self.command("Page.navigate", {"url": url})
        if navigated.get("errorText"):
            raise BrowserError(f"cannot load {url}: {navigated['errorText']}")
        await self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    async def reload(self) -> None:
        await self.evaluate("window.__reloading = true")
        await self.command("Page.reload", {"ignoreCache": False})
        await self.wait_for(
            "!window.__reloading && document.readyState === 'complete'", what="the reload"
        )

    async def type_text(self, selector: str, text: str) -> None:
        """Focus ``selector`` and type ``text`` into it, as a keyboard would."""
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.command("Input.insertText", {"text": text})

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.command(
                "Input.dispatchKeyEvent",
                {
                    "type": kind,
                    "key": "Enter",
                    "code": "Enter",
                    "windowsVirtualKeyCode": 13,
                    "text": "\r" if kind == "keyDown" else "",
                },
            )

    async def click(self, selector: str) -> None:
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")

    async def screenshot(self) -> bytes:
        shot = await self.command("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(shot["data"])


async def _devtools_url(profile: Path, process: trio.Process, log: Path) -> str:
    # Chromium writes the port it chose and the browser's path, once it listens.
    active = trio.Path(profile / "DevToolsActivePort")
    with trio.move_on_after(60):
        while True:
            if process.poll() is not None:
                tail = (await trio.Path(log).read_text())[-2000:]
                raise BrowserError(f"chromium exited ({process.returncode}): {tail}")
            lines = (await active.read_text()).splitlines() if await active.exists() else []
            if len(lines) >= 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            await trio.sleep(0.05)
    tail = (await trio.Path(log).read_text())[-2000:]
    raise BrowserError(f"chromium did not open its DevTools port: {tail}")


@asynccontextmanager
async def open_browser(executable: str, args: Sequence[str] = ()) -> AsyncIterator[Browser]:
    """Start headless Chromium (``executable``: :func:`chromium_or_skip`, called
    before any task starts, so that a skip keeps its reason) with extra ``args``;
    stop it on the way out."""
    # Chromium's helper processes can outlive the browser for a moment and
    # write into the profile while it is removed: they are stopped with the
    # browser's process group below, and a file one of them still wrote is
    # no reason to fail a test.
    with tempfile.TemporaryDirectory(
        prefix="trioserve-chromium-", ignore_cleanup_errors=True
    ) as directory:
        profile = Path(directory) / "profile"
        log = Path(directory) / "chromium.log"
        command = [
            executable,
            "--headless",
            "--disable-gpu",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--mute-audio",
            "--password-store=basic",
            # Every server here is on loopback: never ask a proxy from the environment.
            "--no-proxy-server",
            *args,
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # Chromium's sandbox refuses to run as root (containers, CI machines).
            command.append("--no-sandbox")
        command.append("about:blank")
        with log.open("wb") as log_file:
            process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,  # its own process group, helpers included
            )
        try:
            url = await _devtools_url(profile, process, log)
            async with (
                trio_websocket.open_websocket_url(url, max_message_size=_MAX_MESSAGE) as ws,
                trio.open_nursery() as nursery,
            ):
                browser = Browser(ws)
                nursery.start_soon(browser.read)
                try:
                    yield browser
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            process.terminate()
            with trio.move_on_after(10) as waited:
                await process.wait()
            if waited.cancelled_caught:
                process.kill()
                await process.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the helpers still running
