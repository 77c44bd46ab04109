"""A sandboxed run's state socket: how the commands of ``python`` and ``shell`` reach their
own run's state (``ctx.state``), and nothing else.

The server makes a socket pair per run and hands the sandbox one end as an inherited
descriptor (``$STARGRPC_STATE_FD``); the other end is served for that run alone. No path,
name or number identifies it anywhere: a process reaches it only by inheriting it from the
run's command (or by being handed it by one), so there is nothing another run could guess,
and no request names a run or a principal: the server answers with the ``ctx.state`` of the
run it made the socket for, in the scopes the operator offers (``sandbox_state_scopes``:
``run`` and ``tree`` by default). The client side, the ``stargrpc_state`` module and the
``stargrpc-state`` command, is :mod:`stargrpc.sandbox.state_client`, whose docstring
describes the wire.

Each client sends the socket (a ``SOCK_SEQPACKET`` pair, the *broker*) one end of a
``SOCK_STREAM`` pair of its own (``SCM_RIGHTS``), so that the processes of a run each hold a
conversation of their own. What is refused, and how:

- a descriptor that is not an unnamed Unix stream socket (a file, a pipe, a TCP connection
  or one to a named socket the run opened): closed unanswered;
- more than :data:`MAX_CONNECTIONS` conversations at once, or more than
  ``sandbox_state_requests_per_second`` requests and conversations a second (bursts up to
  as many): ``STATE_RATE_LIMITED`` (and the broker is not read until the rate allows: a
  flood fills the kernel's buffer and blocks its sender);
- a line longer than :func:`max_request_bytes`: ``STATE_REQUEST_TOO_LARGE``, then the
  conversation is closed;
- a line that is not a JSON object of a known operation with its fields of the right
  types (a ``run_id`` or ``principal`` field included): ``STATE_BAD_REQUEST``;
- a scope not offered: ``STATE_SCOPE_NOT_OFFERED``; keys, values, ttls and quotas are
  checked by :class:`~stargrpc.runs.state.RunState`, with its codes.

The socket lives as long as the command: :meth:`StateSocket.aclose` ends every conversation
when the run's command is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shlex
import socket
import stat
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from stargrpc.errors import ToolOutcomeError
from stargrpc.runs.state import SCOPES, RunState
from stargrpc.sandbox import state_client
from stargrpc.sandbox.isolation import SANDBOX_PATH

if TYPE_CHECKING:
    from stargrpc.runs.context import ToolContext

log = structlog.get_logger("stargrpc.sandbox")

#: Conversations one run may hold open at once.
MAX_CONNECTIONS = 8
#: The fields each operation takes besides ``op`` and ``scope``; the first are required.
_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "get": (("key",), ()),
    "set": (("key", "value"), ("ttl",)),
    "cas": (("key", "expected", "value"), ("ttl",)),
    "incr": (("key",), ("by", "ttl")),
    "delete": (("key",), ()),
    "keys": ((), ("prefix",)),
}
#: The folder in the sandbox root that holds the client (module and command).
CLIENT_FOLDER = "stargrpc-state-client"


def max_request_bytes(max_value_bytes: int) -> int:
    """The longest request line: a compare_and_set carries two values, each at most
    ``state_max_value_bytes`` as the server encodes it and up to twice that as a client may
    (escapes), and its key and field names."""
    return 4 * max_value_bytes + 64 * 1024


class _Bucket:
    """A token bucket: ``rate`` a second, up to ``rate`` at once.

    Attributes:
        rate: Tokens a second.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._capacity = max(rate, 1.0)
        self._tokens = self._capacity
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self) -> bool:
        """Whether a token was there (and is now spent)."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_seconds(self) -> float:
        """How long until a token is there."""
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self.rate)


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _refusal(code: str, message: str) -> bytes:
    return _line({"ok": False, "code": code, "message": message})



def _line(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class StateSocket:
    """Serves one run's state to its sandbox (see the module docstring).

    Attributes:
        env: The environment the sandboxed command gets (``STARGRPC_STATE_FD``, and the
            client on ``PATH`` and ``PYTHONPATH``).
        pass_fds: The descriptors the command inherits.
        read_only_paths: Host folders the command must see (the client).
    """

    env: dict[str, str]
    pass_fds: tuple[int, ...]
    read_only_paths: tuple[Path, ...]

    def __init__(self, state: Callable[[str], RunState], *, scopes: Sequence[str],
                 requests_per_second: float, max_value_bytes: int,
                 client_dir: Path, run_id: str = "") -> None:
        """
        Args:
            state: The run's ``ctx.state``.
            run_id: The run, for the log line that counts its refusals.
            scopes: The scopes offered.
            requests_per_second: The rate allowed (requests and conversations).
            max_value_bytes: ``state_max_value_bytes``.
            client_dir: The folder of the client (:func:`client_dir`).
        """
        self._state = state
        self._scopes = tuple(scopes)
        self._bucket = _Bucket(requests_per_second)
        self._limit = max_request_bytes(max_value_bytes)
        self._broker, self._child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._broker.setblocking(False)
        self._connections: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._reading = False
        self._resume: asyncio.TimerHandle | None = None
        self._closed = False
        self._run_id = run_id
        #: Refusals by code, logged once when the socket closes (a flood is one line).
        self.refusals: Counter[str] = Counter()
        fd = self._child.fileno()
        self.pass_fds = (fd,)
        self.read_only_paths = (client_dir,)
        self.env = state_env(client_dir, fd)
        self._read_broker()

    def adopt(self, broker: socket.socket, child: socket.socket) -> None:
        """Serves ``broker`` from now on instead of the pair made for the command: the
        server's end of a pooled sandbox's own state socket, which that sandbox held from
        its start and which nothing served before (:mod:`stargrpc.sandbox.warm`), and
        ``child``, the sandbox's end, which the server keeps open as it does a run's own
        (so the broker never reads an end of file: the sandbox's processes exiting close
        only their copies). The pair made here is closed; ``pass_fds`` and ``env`` no
        longer name a socket of this run."""
        if self._closed:
            broker.close()
            child.close()
            return
        self._drop_pair()
        broker.setblocking(False)
        self._broker, self._child = broker, child
        self.pass_fds = ()
        self._read_broker()

    def _drop_pair(self) -> None:
        """Stops reading the broker and closes both ends of the pair it serves."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._reading:
            self._loop.remove_reader(self._broker.fileno())
            self._reading = False
        self._broker.close()
        self._child.close()

    @property
    def connections(self) -> int:
        """Conversations open now."""
        return len(self._connections)

    def _read_broker(self) -> None:
        self._resume = None
        if not self._closed and not self._reading:
            self._loop.add_reader(self._broker.fileno(), self._on_broker)
            self._reading = True

    def _pause_broker(self, seconds: float) -> None:
        if self._reading:
            self._loop.remove_reader(self._broker.fileno())
            self._reading = False
        if self._resume is None:
            self._resume = self._loop.call_later(seconds, self._read_broker)

    def _on_broker(self) -> None:
        try:
            _, fds, _, _ = socket.recv_fds(self._broker, 16, 1)
        except BlockingIOError:
            return
        except OSError as exc:  # not expected while the server holds the other end
            log.warning("state_socket_broker_failed", error=str(exc))
            self._pause_broker(1.0)
            return
        # An empty message (the server holds the sandbox's end, so it is no end of file)
        # or one whose descriptor the kernel dropped (more than one sent) opens nothing.
        for fd in fds:
            self._accept(fd)

    def _accept(self, fd: int) -> None:
        try:
            conversation = socket.socket(fileno=fd)
        except OSError:  # not a socket at all
            os.close(fd)
            return
        try:
            # Only an unnamed Unix stream socket: not a TCP connection or one to a named
            # socket the run opened itself (the server would talk to it on the run's
            # behalf).
            if (conversation.family != socket.AF_UNIX
                    or conversation.type != socket.SOCK_STREAM
                    or conversation.getpeername() not in ("", b"")):
                conversation.close()
                return
        except OSError:  # not connected
            conversation.close()
            return
        conversation.setblocking(False)
        if not self._bucket.take():
            self._refuse_now(conversation, "STATE_RATE_LIMITED", "more than "
                             f"{self._bucket.rate:g} state requests a second "
                             "(sandbox_state_requests_per_second); try again later")
            self._pause_broker(self._bucket.wait_seconds())
            return
        if len(self._connections) >= MAX_CONNECTIONS:
            self._refuse_now(conversation, "STATE_RATE_LIMITED", "more than "
                             f"{MAX_CONNECTIONS} state connections open at once; close one")
            return
        task = self._loop.create_task(self._converse(conversation))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    def _refuse_now(self, conversation: socket.socket, code: str, message: str) -> None:
        self.refusals[code] += 1
        with contextlib.suppress(OSError):
            conversation.send(_refusal(code, message))  # a fresh socket: room for a line
        conversation.close()

    async def _converse(self, conversation: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conversation,
                                                           limit=self._limit)
        except OSError:  # closed by its client meanwhile
            conversation.close()
            return
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    return  # the client is done
                except asyncio.LimitOverrunError:
                    self.refusals["STATE_REQUEST_TOO_LARGE"] += 1
                    writer.write(_refusal(
                        "STATE_REQUEST_TOO_LARGE", f"a state request is at most "
                        f"{self._limit} bytes (a line); this connection is closed"))
                    await writer.drain()
                    return
                if self._bucket.take():
                    writer.write(await self._answer(line))
                else:
                    self.refusals["STATE_RATE_LIMITED"] += 1
                    writer.write(_refusal(
                        "STATE_RATE_LIMITED", f"more than {self._bucket.rate:g} state "
                        "requests a second (sandbox_state_requests_per_second); try again "
                        f"in {self._bucket.wait_seconds():.3f} s"))
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            writer.close()

    async def _answer(self, line: bytes) -> bytes:
        try:
            op, scope, fields = self._parse(line)
            state = self._state(scope)
            return _line({"ok": True, **await self._apply(state, op, fields)})
        except _Refused as exc:
            self.refusals[exc.code] += 1
            return _refusal(exc.code, exc.message)
        except ToolOutcomeError as exc:  # the StateError codes (StateReadOnly is a denial)
            self.refusals[exc.code] += 1
            return _refusal(exc.code, exc.message)
        except RecursionError:
            self.refusals["STATE_VALUE_NOT_JSON"] += 1
            return _refusal("STATE_VALUE_NOT_JSON", "a state value is nested too deeply")

    def _parse(self, line: bytes) -> tuple[str, str, dict[str, Any]]:
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise _Refused("STATE_BAD_REQUEST", f"a state request is one JSON object a "
                           f"line: {exc}") from None
        if not isinstance(request, dict):
            raise _Refused("STATE_BAD_REQUEST", "a state request is a JSON object, not "
                           f"{type(request).__name__}")
        op = request.pop("op", None)
        if op not in _FIELDS:
            raise _Refused("STATE_BAD_REQUEST", f"no state operation {op!r}: use one of "
                           f"{', '.join(_FIELDS)}")
        scope = request.pop("scope", "run")
        if scope not in self._scopes:
            if scope in SCOPES:
                raise _Refused("STATE_SCOPE_NOT_OFFERED", f"the {scope} scope is not "
                               "offered to sandboxed runs (sandbox_state_scopes: "
                               f"{', '.join(self._scopes)})")
            raise _Refused("STATE_BAD_SCOPE", f"no state scope {scope!r}: sandboxed runs "
                           f"reach {', '.join(self._scopes)}")
        required, optional = _FIELDS[op]
        for name in request:
            if name not in required and name not in optional:
                raise _Refused("STATE_BAD_REQUEST", f"{op} takes no field {name!r}: a "
                               "sandboxed run reaches its own run's state only, and names "
                               "no run or principal" if name in ("run", "run_id", "root_run_id",
                                                                 "principal", "tree")
                               else f"{op} takes no field {name!r}")
        for name in required:
            if name not in request:
                raise _Refused("STATE_BAD_REQUEST", f"{op} needs the field {name!r}")
        ttl = request.get("ttl")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
            raise _Refused("STATE_BAD_REQUEST", f"ttl is a number of seconds, not {ttl!r}")
        return op, scope, request

    @staticmethod
    async def _apply(state: RunState, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        key = fields.get("key")
        ttl = fields.get("ttl")
        if op == "get":
            missing = object()
            value = await state.get(key, missing)  # type: ignore[arg-type]
            return {"found": False} if value is missing else {"found": True, "value": value}
        if op == "set":
            await state.set(key, fields["value"], ttl=ttl)  # type: ignore[arg-type]
            return {}
        if op == "cas":
            return {"value": await state.compare_and_set(
                key, fields["expected"], fields["value"], ttl=ttl)}  # type: ignore[arg-type]
        if op == "incr":
            return {"value": await state.increment(key, fields.get("by", 1),  # type: ignore
                                                   ttl=ttl)}
        if op == "delete":
            return {"value": await state.delete(key)}  # type: ignore[arg-type]
        return {"value": await state.keys(fields.get("prefix", ""))}

    async def aclose(self) -> None:
        """Ends every conversation and closes the socket (the run's command is over)."""
        if self._closed:
            return
        self._closed = True
        self._drop_pair()
        if self.refusals:  # what the command tried that the socket refused
            log.warning("state_socket_refusals", run_id=self._run_id,
                        refusals=dict(self.refusals))
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def state_env(client: Path, fd: int) -> dict[str, str]:
    """The environment of a command whose state descriptor is ``fd``: its number in
    ``$STARGRPC_STATE_FD``, and the client of ``client`` (:func:`client_dir`) on ``PATH``
    and ``PYTHONPATH``."""
    return {state_client.FD_VARIABLE: str(fd), "PATH": f"{client / 'bin'}:{SANDBOX_PATH}",
            "PYTHONPATH": str(client)}


def open_state_socket(ctx: ToolContext, root: Path) -> StateSocket | None:
    """The state socket of the run of ``ctx``, or None when ``sandbox_state_scopes`` is
    empty.

    Args:
        ctx: The sandboxed tool's context.
        root: The sandbox root (where the client is kept).
    """
    settings = ctx.settings
    if not settings.sandbox_state_scopes:
        return None
    return StateSocket(ctx.state, scopes=settings.sandbox_state_scopes,
                       requests_per_second=settings.sandbox_state_requests_per_second,
                       max_value_bytes=settings.state_max_value_bytes,
                       client_dir=client_dir(root, settings.sandbox_python),
                       run_id=ctx.run_id)


@functools.cache
def client_dir(root: Path, python: str) -> Path:
    """``<root>/stargrpc-state-client``: the ``stargrpc_state`` module and ``bin/
    stargrpc-state``, readable by every sandbox user, written by the server (once per
    process) and by nobody else.

    Raises:
        RuntimeError: Something else is in its place.
    """
    folder = root / CLIENT_FOLDER
    bin_dir = folder / "bin"
    for made in (folder, bin_dir):
        with contextlib.suppress(FileExistsError):
            os.mkdir(made, 0o755)
        info = os.lstat(made)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise RuntimeError(f"{made} is not a folder of the server's user; remove it")
        os.chmod(made, 0o755, follow_symlinks=False)
    source = Path(state_client.__file__).read_bytes()
    command = (f"#!/bin/sh\nexec {shlex.quote(python)} -I {shlex.quote(str(folder))}"
               "/stargrpc_state.py \"$@\"\n").encode()
    _write(folder, "stargrpc_state.py", source, 0o644)
    _write(bin_dir, "stargrpc-state", command, 0o755)
    return folder


def _write(folder: Path, name: str, data: bytes, mode: int) -> None:
    """Replaces ``folder/name`` with ``data`` at once (a reader never sees half)."""
    temporary = folder / f".{name}.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        os.fchmod(handle.fileno(), mode)
    os.replace(temporary, folder / name)
