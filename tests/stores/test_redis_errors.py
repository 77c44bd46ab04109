"""What a caller is told of each Redis failure comes from one table
(:data:`stargrpc.stores.redis.errors.FAILURES`): UNAVAILABLE with a retry delay, a reason
that says whether to retry shortly, a message naming what the store was doing, and one
log line."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError
from structlog.testing import capture_logs

from stargrpc.errors import Unavailable
from stargrpc.stores.redis.errors import (
    RETRY_AFTER_SECONDS,
    ClaimTooLate,
    KeyVanished,
    NotReplicated,
    request_error,
)


@pytest.mark.parametrize(("failure", "reason", "told", "logged"), [
    (NotReplicated("0 of 1 Redis replicas acknowledged the write"), "RUN_STORE_UNAVAILABLE",
     "did not confirm the write on its replicas (listing runs: 0 of 1",
     ("redis_unavailable", "0 of 1 Redis replicas acknowledged the write")),
    (RedisConnectionError("refused"), "RUN_STORE_UNAVAILABLE",
     "(Redis) is unreachable (listing runs)", ("redis_unavailable", "refused")),
    (RedisTimeoutError("no answer in time"), "RUN_STORE_UNAVAILABLE",
     "(Redis) is unreachable (listing runs)", ("redis_unavailable", "no answer in time")),
    (TryAgainError("keys moving"), "RUN_STORE_UNAVAILABLE",
     "(Redis Cluster) is moving or failing over this run's slot (listing runs)",
     ("redis_unavailable", "slot moving: keys moving")),
    (TimeoutError(), "RUN_STORE_UNAVAILABLE", "(Redis) did not answer in time (listing runs)",
     ("redis_unavailable", "no answer in time")),
    (ClaimTooLate(), "RUN_STORE_UNAVAILABLE", "(Redis) did not answer in time (listing runs)",
     ("redis_unavailable", "the call's deadline passed before Redis took the claim")),
    (KeyVanished("the page token key"), "RUN_STORE_UNAVAILABLE",
     "the shared run store lost the page token key; retry", None),
    (ResponseError("ERR something"), "RUN_STORE_FAILED", "(Redis) failed (listing runs)",
     ("redis_failed", "ERR something")),
])
def test_each_redis_failure_is_told_as_the_table_says(
        failure: BaseException, reason: str, told: str,
        logged: tuple[str, str] | None) -> None:
    with capture_logs() as logs:
        error = request_error(failure, "listing runs")

    assert isinstance(error, Unavailable)
    assert error.reason == reason and error.retry_after == RETRY_AFTER_SECONDS
    assert told in error.message
    assert [(line["event"], line["error"]) for line in logs] == ([logged] if logged else [])


def test_what_is_no_redis_failure_is_not_mapped() -> None:
    with pytest.raises(TypeError):
        request_error(ValueError("a bug"), "listing runs")
