"""The cuts a call's record names, read from the notices before a Result, however the
events were split into batches on their way to the call; a delta's text split into pieces
an event may carry."""

from __future__ import annotations

import itertools

from stargrpc.runs.event_sizes import (
    OUTPUT_TRUNCATED,
    RESULT_TOO_LARGE,
    cuts_before_result,
    split_utf8,
    trailing_notices,
)
from stargrpc.v1 import events_pb2


def _notice(code: str) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.notice.code = code
    event.notice.message = code.lower()
    return event


def _delta() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.delta = "x"
    return event


def _result() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.result.output = "done"
    return event


def test_the_cuts_before_a_result_are_found_wherever_the_batches_split() -> None:
    run = [_delta(), _notice("STEERED"), _delta(), _notice(RESULT_TOO_LARGE),
           _notice(OUTPUT_TRUNCATED), _result()]
    expected = ["RESULT_TOO_LARGE: result_too_large", "OUTPUT_TRUNCATED: output_truncated"]
    for count in range(len(run)):
        for cuts in itertools.combinations(range(1, len(run)), count):
            bounds = [0, *cuts, len(run)]
            batches = [run[start:end] for start, end in itertools.pairwise(bounds)]
            notices: list[events_pb2.RunEvent] = []
            for batch in batches[:-1]:
                notices = trailing_notices(notices, batch)
            assert cuts_before_result([*notices, *batches[-1]]) == expected, bounds


def test_a_delta_is_split_on_characters_with_its_lone_surrogates_escaped() -> None:
    # Short, between the quick bound and the cap, and past the cap: every piece is text a
    # protobuf string takes, within the cap, and together they are the escaped text.
    for text in ("é\udcff", "é" * 20 + "\udcff", "€\ud800" * 40, "\ud800" * 16):
        pieces = split_utf8(text, 64)
        assert all(len(piece.encode()) <= 64 for piece in pieces)
        assert "".join(pieces) == text.encode(errors="backslashreplace").decode()
    assert split_utf8("€" * 100, 64) == ["€" * 21, "€" * 21, "€" * 21, "€" * 21, "€" * 16]
