"""What ExLlamaV2's WebSocket server (``exllamav2/server/websocket_actions.py``,
v0.3.2) sends for each request, written down from the reference notes
(/work/shared/reference/exllamav2.md, section 1) so that trioserve's frames can
be compared with it key by key.

For a request, :func:`seed_frames` gives the sequence of frames the seed
sends: each a :class:`SeedFrame` mapping every key the seed puts in the frame
to a rule for its value (an exact value computed from the request, a type,
one of a few values). ``repeat`` marks the chunk frame, sent zero or more
times. :func:`compare` checks a sequence of frames received from trioserve
against it: every seed key must be there, with a value the rule accepts;
keys the seed does not send are trioserve's extensions and are listed.

Only what the seed does on purpose is written here. Its defects (section 7 of
the notes: no answer to errors, a one-element list as ``util_text`` after
trimming, ``stop`` replying before the interrupted frame) are repaired by
trioserve and are not part of the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["SeedFrame", "compare", "seed_frames"]


@attrs.frozen
class Rule:
    """A rule for one value, with words for a failure message."""

    describe: str
    check: Callable[[Any], bool]


def exactly(value: Any) -> Rule:
    # JSON equality: a bool is not an int, 1 is 1.0.
    return Rule(f"== {value!r}", lambda got: _json_equal(got, value))


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_json_equal, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def of_type(kind: type[Any], *, non_empty: bool = False) -> Rule:
    def check(got: Any) -> bool:
        if isinstance(got, bool) and kind is not bool:
            return False
        return isinstance(got, kind) and (not non_empty or bool(got))

    return Rule(f"a non-empty {kind.__name__}" if non_empty else f"a {kind.__name__}", check)


def one_of(*values: Any) -> Rule:
    return Rule(f"one of {values!r}", lambda got: got in values)


@attrs.frozen
class SeedFrame:
    """One frame the seed sends: key -> rule for its value."""

    keys: dict[str, Rule]
    #: Sent zero or more times (a chunk frame).
    repeat: bool = False
    #: Keys the seed never sends in this frame, whose absence clients read
    #: (a chunk frame has no ``stop_reason``).
    absent: frozenset[str] = frozenset()


def _ids(request: dict[str, Any], *, tag: bool = False) -> dict[str, Rule]:
    """The echoed keys: copied only when present in the request (section 1.1);
    ``tag`` by ``infer`` only (section 1.5)."""
    keys = ("request_id", "response_id", "tag") if tag else ("request_id", "response_id")
    return {key: exactly(request[key]) for key in keys if key in request}


def seed_frames(request: dict[str, Any]) -> list[SeedFrame]:
    """The frames the seed sends for ``request``, in order."""
    action = request["action"]
    head = {"action": exactly(action)}
    if action == "echo":
        # 1.2: the action and the ids, nothing else.
        return [SeedFrame({**head, **_ids(request)})]
    if action == "estimate_token":
        # 1.3: num_tokens, the count of text's tokens without BOS.
        return [SeedFrame({**head, **_ids(request), "num_tokens": of_type(int)})]
    if action == "lefttrim_token":
        # 1.4: the text itself when it fits, else the decoded last tokens.
        return [SeedFrame({**head, **_ids(request), "trimmed_text": of_type(str)})]
    if action == "stop":
        # 1.6: the action and the ids.
        return [SeedFrame({**head, **_ids(request)})]
    if action == "infer":
        # 1.5: util_text is the prompt used: customBos + text when nothing
        # was trimmed (the only case compared here).
        util_text = exactly(request.get("customBos", "") + request["text"])
        envelope = {**head, **_ids(request, tag=True), "util_text": util_text}
        chunk = {
            **envelope,
            "response_type": exactly("chunk"),
            "chunk": of_type(str, non_empty=True),
        }
        if request.get("stream_full"):
            chunk["response"] = of_type(str)
        final = {
            **envelope,
            "chunk": exactly(""),
            "response_type": exactly("full"),
            "response": of_type(str),
            "stop_reason": one_of("eos", "num_tokens", "interrupted"),
        }
        frames = [SeedFrame(final)]
        if request.get("stream"):
            frames.insert(0, SeedFrame(chunk, repeat=True, absent=frozenset({"stop_reason"})))
        return frames
    raise ValueError(f"the seed has no action {action!r}")


def compare(frames: Sequence[dict[str, Any]], expected: Sequence[SeedFrame]) -> set[str]:
    """Check ``frames`` against the seed's sequence, key by key; raise
    AssertionError naming the first difference. Returns the keys trioserve
    added (its extensions)."""
    added: set[str] = set()
    position = 0
    for seed in expected:
        while True:
            if position >= len(frames):
                if seed.repeat:
                    break
                raise AssertionError(f"missing frame: the seed sends {sorted(seed.keys)}")
            frame = frames[position]
            if seed.repeat and not seed.keys["response_type"].check(frame.get("response_type")):
                break
            for key, rule in seed.keys.items():
                if key not in frame:
                    raise AssertionError(f"frame {position} lacks the seed key {key!r}: {frame}")
                if not rule.check(frame[key]):
                    raise AssertionError(
                        f"frame {position}: {key!r} is {frame[key]!r}, the seed's is "
                        f"{rule.describe}: {frame}"
                    )
            for key in seed.absent & set(frame):
                raise AssertionError(f"frame {position} has {key!r}, which the seed never sends")
            added |= set(frame) - set(seed.keys)
            position += 1
            if not seed.repeat:
                break
    if position != len(frames):
        raise AssertionError(f"frames the seed does not send: {frames[position:]}")
    return added
