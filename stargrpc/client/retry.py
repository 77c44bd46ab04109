"""When the client retries, and how long it waits in between."""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from stargrpc.client.errors import CallError
from stargrpc.contract import reason_name
from stargrpc.v1 import errors_pb2

#: Codes on which a call that has not started a run is sent again (same idempotency key).
#: RESOURCE_EXHAUSTED only counts when the server said when to come back (RetryInfo).
RETRYABLE_BEFORE_RUN = frozenset({grpc.StatusCode.UNAVAILABLE})

#: The refusal with RetryInfo that is never retried: LANE_BUSY, the caller's own limit.
NOT_RETRIED_REASON = reason_name(errors_pb2.LANE_BUSY)

#: Codes that end a stream the client was reading without ending the run: the client
#: resumes with WatchRun. DEADLINE_EXCEEDED is missing on purpose: it is the caller's own
#: deadline, which always wins.
RESUMABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    # A watcher that fell too far behind is ended with this and told to resume.
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, bounded in attempts.

    Attributes:
        max_attempts: Tries per call (or per resume) including the first; 1 never retries.
            The count starts again whenever a stream delivers an event.
        initial_backoff: Seconds before the first retry.
        max_backoff: Longest wait between two tries, unless the server asks for longer
            with RetryInfo.
        multiplier: Growth of the wait per retry.
        jitter: Fraction of each wait chosen at random (0.2: between 80 % and 100 %), so
            clients refused together do not come back together.
        max_retry_delay: The longest RetryInfo delay the client agrees to wait; a server
            asking for more gets the error passed to the caller instead.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_retry_delay: float = 60.0

    def backoff(self, attempt: int) -> float:
        """The wait before try ``attempt + 1`` after ``attempt`` failed tries (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * (1 - self.jitter * random.random())

    def delay(self, attempt: int, error: CallError) -> float | None:
        """How long to wait before trying again after ``error``, or None to give up.

        The server's RetryInfo wins over the backoff when it asks for longer.
        """
        if attempt >= self.max_attempts:
            return None
        if error.retry_delay is not None:
            if error.retry_delay > self.max_retry_delay:
                return None
            return max(error.retry_delay, self.backoff(attempt))
        return self.backoff(attempt)

    def should_retry_call(self, error: CallError) -> bool:
        """Whether a call refused before any run started may be sent again (not LANE_BUSY:
        the caller's own ``max_wait_seconds`` refused the wait its RetryInfo estimates)."""
        if error.code in RETRYABLE_BEFORE_RUN:
            return True
        return (error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_delay is not None
                and error.reason != NOT_RETRIED_REASON)


#: Never retries; for callers that handle failures themselves.
NO_RETRY = RetryPolicy(max_attempts=1)
