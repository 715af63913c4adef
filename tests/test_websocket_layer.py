"""trio-websocket's private surface, as trioserve/server/websocket.py uses it.

ServerWebSocket overrides two of WebSocketConnection's event handlers and
calls three more of its private methods and attributes. A trio-websocket
release may change any of them without notice, so the requirement has an upper
bound and these tests name what changed, instead of leaving it to the hostile
tests' symptoms (a frame limit that no longer holds, a close frame never sent).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import tomllib
from pathlib import Path

import pytest
import trio
import trio.testing
from packaging.requirements import Requirement
from trio_websocket import WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.events import TextMessage

from trioserve.server.websocket import ServerWebSocket

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

#: What server/websocket.py calls or overrides: name -> parameters.
PRIVATE_METHODS = {
    "_handle_message_event": ["self", "event"],
    "_handle_close_connection_event": ["self", "event"],
    "_send": ["self", "event"],
    "_reader_task": ["self"],
    "_get_request": ["self"],
}


def requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (line,) = [r for r in project["dependencies"] if Requirement(r).name == "trio-websocket"]
    return Requirement(line)


def test_the_requirement_is_bounded_and_the_installed_release_is_inside_it() -> None:
    pin = requirement()
    assert any(spec.operator == "<" for spec in pin.specifier), pin
    installed = importlib.metadata.version("trio-websocket")
    assert pin.specifier.contains(installed), (installed, str(pin))


def test_the_private_methods_are_there_with_their_parameters() -> None:
    for name, parameters in PRIVATE_METHODS.items():
        method = getattr(WebSocketConnection, name, None)
        assert method is not None, f"trio-websocket's WebSocketConnection lost {name}"
        assert inspect.iscoroutinefunction(method), name
        assert list(inspect.signature(method).parameters) == parameters, name


def connection(max_message_size: int) -> ServerWebSocket:
    stream, _ = trio.testing.memory_stream_pair()
    return ServerWebSocket(
        stream, WSConnection(ConnectionType.SERVER), max_message_size=max_message_size
    )


async def test_the_base_class_counts_characters_and_the_override_adds_the_rest() -> None:
    # The override adds (UTF-8 bytes - characters) because the base adds
    # characters. A release that counts bytes itself would make the override
    # count them twice: this test fails then, naming the cause.
    text = "é€😀"  # 3 characters, 2 + 3 + 4 bytes
    base = connection(1_000)
    assert (base._message_size, base._close_reason) == (0, None)
    assert base._wsproto is not None
    await WebSocketConnection._handle_message_event(
        base, TextMessage(data=text, message_finished=False)
    )
    assert base._message_size == len(text) == 3
    ours = connection(1_000)
    await ours._handle_message_event(TextMessage(data=text, message_finished=False))
    assert ours._message_size == len(text.encode()) == 9
