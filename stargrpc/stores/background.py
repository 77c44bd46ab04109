"""Stopping a store's background loops (renewal, sweep, flush, polling) for sure.

Some redis-py releases (8.0.x, which agent frameworks' pins still install) swallow a
cancellation that lands while the client reconnects to a Redis that is down: a plain
``task.cancel()`` then ``await task`` waits for ever, and a server that lost Redis cannot shut
down. :func:`stop_background` sends the cancellation again until the task has ended, bounded:
the loop's next await takes one that is not swallowed.
"""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("stargrpc.stores")

#: Cancellations sent before a loop is given up on (logged, left to the event loop's end).
STOP_ATTEMPTS = 20
#: How long each cancellation is given to take effect.
STOP_WAIT_SECONDS = 0.5


async def stop_background(task: asyncio.Task[None] | None, what: str, *,
                          attempts: int = STOP_ATTEMPTS,
                          wait: float = STOP_WAIT_SECONDS) -> None:
    """Cancels ``task`` until it has ended (at most ``attempts`` times, each given ``wait``
    seconds). An error it ended with is retrieved (logged, not raised): a loop's last failed
    round trip must not fail the shutdown.

    Args:
        task: The loop's task; None (never started, or already stopped) does nothing.
        what: The loop's name for the log, should it refuse to end.
        attempts: Cancellations sent before the loop is given up on (logged).
        wait: Seconds each cancellation is given to take effect.
    """
    if task is None:
        return
    for _ in range(attempts):
        task.cancel()
        await asyncio.wait({task}, timeout=wait)
        if task.done():
            break
    else:
        log.warning("redis_loop_not_stopped", loop=what, attempts=attempts)
        return
    if not task.cancelled() and task.exception() is not None:
        log.warning("redis_loop_ended_with_error", loop=what, error=repr(task.exception()))
