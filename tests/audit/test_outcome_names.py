"""A run's outcome in its audit record, named from the Result's outcome enum."""

from __future__ import annotations

from stargrpc.audit.record import OUTCOMES, outcome_for_result
from stargrpc.v1 import events_pb2


def test_every_outcome_of_a_result_is_named_as_the_enum_names_it() -> None:
    for name, value in events_pb2.Outcome.items():
        expected = name.removeprefix("OUTCOME_").lower()
        named = outcome_for_result(events_pb2.Result(outcome=value))
        assert named == (expected if expected in OUTCOMES else "error"), name
    assert outcome_for_result(events_pb2.Result()) == "error"  # unspecified
    assert outcome_for_result(events_pb2.Result(outcome=events_pb2.OUTCOME_OK)) == "ok"


def test_an_outcome_this_version_does_not_know_is_an_error() -> None:
    # A Result from a newer peer (an open enum keeps unknown values): still a record.
    result = events_pb2.Result()
    result.ParseFromString(b"\x08\x63")  # field 1 (outcome) = 99
    assert result.outcome == 99
    assert outcome_for_result(result) == "error"
