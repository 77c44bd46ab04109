"""The blocking client: :class:`Client`.

It runs an :class:`~stargrpc.client.aio.AsyncClient` on an event loop in a background
thread, so both clients share one implementation of retries, resume and catalog reload.
Streams keep backpressure: the next event is read only when the caller asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from stargrpc.client.aio import AsyncClient, Metadata
from stargrpc.client.channel import open_channel
from stargrpc.client.events import Catalog, Event, Result
from stargrpc.client.retry import RetryPolicy
from stargrpc.v1 import state_pb2, tool_service_pb2

T = TypeVar("T")

_DONE = object()


class Client:
    """A blocking client of a stargrpc server; the same API as
    :class:`~stargrpc.client.aio.AsyncClient`, with iterators instead of async iterators.

    Example::

        with Client("localhost:50051", api_key=key) as client:
            for event in client.execute("count", {"to": 3}):
                print(event)
            print(client.call("echo", {"text": "hi"}).output)

    Args:
        target: ``host:port``; ignored when ``channel_factory`` is given.
        channel_factory: Builds the grpc.aio channel to use (injected), called on the
            client's event loop; the client closes that channel in :meth:`close`.
        api_key: An API key, sent as ``authorization: Bearer …`` (or ``token``: a JWT).
        tls: Use TLS (system roots or ``ca_file``).
        ca_file: PEM roots to verify the server with; implies TLS.
        cert_file: Client certificate for mutual TLS, with ``key_file``.
        key_file: The client certificate's private key.
        metadata: Extra metadata for every call.
        retry: The retry policy.
        options: Extra grpc channel options.
    """

    def __init__(self, target: str = "localhost:50051", *,
                 channel_factory: Callable[[], grpc.aio.Channel] | None = None,
                 api_key: str | None = None, token: str | None = None, tls: bool = False,
                 ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                 key_file: str | Path | None = None, metadata: Metadata = (),
                 retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        def make_channel() -> grpc.aio.Channel:
            if channel_factory is not None:
                return channel_factory()
            return open_channel(target, tls=tls, ca_file=ca_file, cert_file=cert_file,
                                key_file=key_file, options=options)

        async def make_client() -> AsyncClient:
            return AsyncClient(make_channel(), api_key=api_key, token=token,
                               metadata=metadata, retry=retry, own_channel=True)

        self._loop = asyncio.new_event_loop()
        # The tasks pumping the streams handed out and not yet finished: close() ends them
        # on the loop, so an iterator the caller dropped half-way does not outlive it.
        self._pumps: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="stargrpc-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(make_client())
        except BaseException:
            self._stop_loop()
            raise

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self._submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt: cancel the call on the loop too
            raise

    def _iterate(self, stream: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
        # One task drives the async iterator and hands items over a one-slot queue, so the
        # server is read only as fast as the caller consumes. Closing the iterator (or an
        # exception in the caller) cancels that task, which cancels the gRPC call.
        handoff: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue(1)

        async def pump() -> None:
            try:
                async for item in stream():
                    await handoff.put((item, None))
            except Exception as exc:
                await handoff.put((_DONE, exc))
                return
            await handoff.put((_DONE, None))

        async def spawn() -> asyncio.Task[None]:
            task = asyncio.get_running_loop().create_task(pump())
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)
            return task

        task = self._run(spawn())
        try:
            while True:
                item, error = self._run(handoff.get())
                if error is not None:
                    raise error
                if item is _DONE:
                    return
                yield item  # type: ignore[misc]
        finally:
            if not self._loop.is_closed():
                self._run(_stop_all({task}))

    # -- the API ---------------------------------------------------------------------------

    @property
    def catalog(self) -> Catalog | None:
        """The last catalog loaded with :meth:`list_tools`."""
        return self._client.catalog

    def list_tools(self, **options: Any) -> Catalog:
        """See :meth:`AsyncClient.list_tools`."""
        return self._run(self._client.list_tools(**options))

    def watch_catalog(self, **options: Any) -> Iterator[Catalog]:
        """See :meth:`AsyncClient.watch_catalog`."""
        return self._iterate(lambda: self._client.watch_catalog(**options))

    def execute(self, tool: str, arguments: Mapping[str, Any] | str | None = None,
                **options: Any) -> Iterator[Event]:
        """See :meth:`AsyncClient.execute`; events as a (blocking) iterator."""
        return self._iterate(lambda: self._client.execute(tool, arguments, **options))

    def call(self, tool: str, arguments: Mapping[str, Any] | str | None = None, *,
             on_event: Callable[[Event], object] | None = None, **options: Any) -> Result:
        """See :meth:`AsyncClient.call`; ``on_event`` runs in the caller's thread."""
        for event in self.execute(tool, arguments, **options):
            if on_event is not None:
                on_event(event)
            if isinstance(event, Result):
                return event
        raise AssertionError("execute() always ends with a Result")  # pragma: no cover

    def watch(self, run_id: str, after_seq: int = 0, **options: Any) -> Iterator[Event]:
        """See :meth:`AsyncClient.watch`."""
        return self._iterate(lambda: self._client.watch(run_id, after_seq, **options))

    def cancel(self, run_id: str, reason: str = "", **options: Any) -> bool:
        """See :meth:`AsyncClient.cancel`."""
        return self._run(self._client.cancel(run_id, reason, **options))

    def steer(self, run_id: str, message: str, **options: Any) -> None:
        """See :meth:`AsyncClient.steer`."""
        self._run(self._client.steer(run_id, message, **options))

    def approve(self, run_id: str, approval_id: str,
                **options: Any) -> tool_service_pb2.ApproveRunResponse:
        """See :meth:`AsyncClient.approve`."""
        reply: tool_service_pb2.ApproveRunResponse = self._run(
            self._client.approve(run_id, approval_id, **options))
        return reply
    def create_session(self, kind: str = "python", **options: Any
                       ) -> tool_service_pb2.Session:
        """See :meth:`AsyncClient.create_session`."""
        return self._run(self._client.create_session(kind, **options))

    def close_session(self, session_id: str, **options: Any) -> None:
        """See :meth:`AsyncClient.close_session`."""
        self._run(self._client.close_session(session_id, **options))

    def list_sessions(self, **options: Any) -> list[tool_service_pb2.Session]:
        """See :meth:`AsyncClient.list_sessions`."""
        return self._run(self._client.list_sessions(**options))

    def list_runs(self, **options: Any) -> tool_service_pb2.ListRunsResponse:
        """See :meth:`AsyncClient.list_runs`."""
        return self._run(self._client.list_runs(**options))

    def get_state(self, scope: str, key: str, default: Any = None, **options: Any) -> Any:
        """See :meth:`AsyncClient.get_state`."""
        return self._run(self._client.get_state(scope, key, default, **options))

    def set_state(self, scope: str, key: str, value: Any, **options: Any) -> None:
        """See :meth:`AsyncClient.set_state`."""
        self._run(self._client.set_state(scope, key, value, **options))

    def delete_state(self, scope: str, key: str, **options: Any) -> bool:
        """See :meth:`AsyncClient.delete_state`."""
        return self._run(self._client.delete_state(scope, key, **options))

    def list_state(self, scope: str, **options: Any) -> state_pb2.ListStateResponse:
        """See :meth:`AsyncClient.list_state`."""
        return self._run(self._client.list_state(scope, **options))

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channel and stops the client's thread; safe to call twice."""
        if self._loop.is_closed():
            return
        try:
            self._run(_stop_all(set(self._pumps)))
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def _stop_all(tasks: set[asyncio.Task[None]]) -> None:
    """Cancels stream pumps (which cancels their gRPC calls) and waits for them to end."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
