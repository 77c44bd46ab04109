"""Run state from inside the sandbox: the ``stargrpc_state`` module and the ``stargrpc-state``
command of sandboxed runs (``python``, ``shell``).

The server copies this file into the sandbox (as ``stargrpc_state.py`` on the ``python``
tool's ``PYTHONPATH``, and behind ``stargrpc-state`` on the sandbox's ``PATH``); it uses the
standard library alone, so any Python 3 the sandbox runs can load it. In a snippet::

    import stargrpc_state

    tree = stargrpc_state.state("tree")
    seen = tree.get("seen", [])
    tree.set("seen", [*seen, "a"], ttl=3600)
    tree.compare_and_set("lock", None, "mine")      # True for exactly one run of the tree
    tree.increment("hits")                          # the new value
    tree.keys("se")                                 # ["seen"]
    tree.delete("seen")                             # whether it was there

From a shell (``$ stargrpc-state --help``)::

    stargrpc-state get KEY                  prints the value's JSON; exit 3 when absent
    stargrpc-state set KEY JSON [--ttl S]
    stargrpc-state cas KEY EXPECTED NEW     prints true / false (exit 1 when false);
                                            EXPECTED null means "only if absent"
    stargrpc-state incr KEY [BY]            prints the new value
    stargrpc-state delete KEY               prints true / false
    stargrpc-state keys [PREFIX]            one key per line
    --scope run|tree|…                      every command; run by default

The wire: the server hands the run's process tree one end of a socket pair (its number in
``$STARGRPC_STATE_FD``). A client makes a socket pair of its own, sends one end over that
descriptor (``SCM_RIGHTS``) and talks on the other, one JSON object per line each way::

    → {"op": "get", "scope": "tree", "key": "seen"}
    ← {"ok": true, "found": true, "value": ["a"]}
    ← {"ok": false, "code": "STATE_BAD_KEY", "message": "…"}

Operations and their fields: ``get`` (key), ``set`` (key, value, ttl), ``cas`` (key,
expected, value, ttl), ``incr`` (key, by, ttl), ``delete`` (key), ``keys`` (prefix); every
request may name a ``scope`` (``run`` when absent). There is no field for a run or a
principal: the socket serves the run it was made for and nobody else.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import socket
import sys
import threading
from typing import Any

#: The environment variable holding the number of the run's state descriptor.
FD_VARIABLE = "STARGRPC_STATE_FD"


class StateError(Exception):
    """The server refused a request (``code`` is a STATE_* error code, as ``ctx.state``
    raises them), or the state socket is missing or closed (``STATE_UNAVAILABLE``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _unavailable(message: str) -> StateError:
    return StateError("STATE_UNAVAILABLE", message)


class Connection:
    """One conversation with the server over a socket pair of its own (thread-safe: one
    request at a time)."""

    def __init__(self, broker_fd: int | None = None) -> None:
        if broker_fd is None:
            text = os.environ.get(FD_VARIABLE, "")
            if not text.isdigit():
                raise _unavailable(f"no run state here (${FD_VARIABLE} is not set): only "
                                   "sandboxed runs of a server that offers it have one")
            broker_fd = int(text)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            broker = socket.socket(fileno=os.dup(broker_fd))
        except OSError as exc:
            mine.close()
            theirs.close()
            raise _unavailable(f"the run's state descriptor {broker_fd} is not usable: "
                               f"{exc}") from None
        try:
            broker.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     array.array("i", [theirs.fileno()]))])
        except OSError as exc:
            mine.close()
            raise _unavailable(f"the server no longer serves this run's state: {exc}") \
                from None
        finally:
            theirs.close()
            broker.close()
        self._socket = mine
        self._file = mine.makefile("rwb")
        self._lock = threading.Lock()

    def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Sends one request; the server's answer when it is ``ok``.

        Raises:
            StateError: The server refused it, or is gone.
        """
        line = json.dumps(request, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        with self._lock:
            try:
                self._file.write(line)
                self._file.flush()
                answer = self._file.readline()
            except OSError as exc:
                raise _unavailable(f"the state socket failed: {exc}") from None
        if not answer:
            raise _unavailable("the server closed the state socket (the run is ending)")
        reply = json.loads(answer)
        if not reply.get("ok"):
            raise StateError(reply.get("code", "STATE_ERROR"), reply.get("message", ""))
        return reply

    def close(self) -> None:
        """Closes the conversation."""
        self._file.close()
        self._socket.close()


_shared: Connection | None = None
_shared_lock = threading.Lock()


def _connection() -> Connection:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Connection()
        return _shared


class Scope:
    """One scope of this run's state (see the module docstring)."""

    def __init__(self, scope: str, connection: Connection | None = None) -> None:
        self.scope = scope
        self._connection = connection

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        connection = self._connection or _connection()
        return connection.request({"op": op, "scope": self.scope, **fields})

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when it is absent."""
        reply = self._ask("get", key=key)
        return reply["value"] if reply.get("found") else default

    def set(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """Sets ``key`` to ``value`` (JSON), for ``ttl`` seconds (None: as long as the
        scope)."""
        self._ask("set", key=key, value=value, ttl=ttl)

    def compare_and_set(self, key: str, expected: Any, value: Any, *,
                        ttl: float | None = None) -> bool:
        """Sets ``key`` to ``value`` only if it holds ``expected`` (None: only if absent);
        whether it did."""
        return bool(self._ask("cas", key=key, expected=expected, value=value,
                              ttl=ttl)["value"])

    def increment(self, key: str, by: int = 1, *, ttl: float | None = None) -> int:
        """Adds ``by`` to the integer at ``key`` (absent: 0); the new value."""
        return int(self._ask("incr", key=key, by=by, ttl=ttl)["value"])

    def delete(self, key: str) -> bool:
        """Removes ``key``; whether it was there."""
        return bool(self._ask("delete", key=key)["value"])

    def keys(self, prefix: str = "") -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        return list(self._ask("keys", prefix=prefix)["value"])


def state(scope: str = "run") -> Scope:
    """This run's state in ``scope`` (``run``, ``tree``; others when the operator offers
    them)."""
    return Scope(scope)


def _json_argument(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"stargrpc-state: {text!r} is not JSON ({exc}); quote a string "
                         "as '\"text\"'") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stargrpc-state", description="This sandboxed run's state (run and tree "
        "scopes), kept by the server.")
    parser.add_argument("--scope", default="run", help="run (default), tree, or another "
                        "scope the operator offers")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("get", help="print the value's JSON (exit 3: absent)")
    command.add_argument("key")
    command = commands.add_parser("set", help="set a value (JSON)")
    command.add_argument("key")
    command.add_argument("value", type=_json_argument)
    command.add_argument("--ttl", type=float)
    command = commands.add_parser("cas", help="compare and set (exit 1: not set)")
    command.add_argument("key")
    command.add_argument("expected", type=_json_argument)
    command.add_argument("value", type=_json_argument)
    command.add_argument("--ttl", type=float)
    command = commands.add_parser("incr", help="add to an integer, print the new value")
    command.add_argument("key")
    command.add_argument("by", nargs="?", type=int, default=1)
    command.add_argument("--ttl", type=float)
    command = commands.add_parser("delete", help="remove a key")
    command.add_argument("key")
    command = commands.add_parser("keys", help="list the keys, one a line")
    command.add_argument("prefix", nargs="?", default="")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``stargrpc-state`` command: 0 done, 1 a cas or delete that changed nothing,
    2 refused (the code and message on stderr), 3 a get of an absent key."""
    args = _parser().parse_args(argv)
    scope = state(args.scope)
    try:
        if args.command == "get":
            missing = object()
            value = scope.get(args.key, missing)
            if value is missing:
                return 3
            print(json.dumps(value, ensure_ascii=False))
        elif args.command == "set":
            scope.set(args.key, args.value, ttl=args.ttl)
        elif args.command == "cas":
            done = scope.compare_and_set(args.key, args.expected, args.value, ttl=args.ttl)
            print(json.dumps(done))
            return 0 if done else 1
        elif args.command == "incr":
            print(scope.increment(args.key, args.by, ttl=args.ttl))
        elif args.command == "delete":
            done = scope.delete(args.key)
            print(json.dumps(done))
            return 0 if done else 1
        else:
            for key in scope.keys(args.prefix):
                print(key)
    except StateError as exc:
        print(f"stargrpc-state: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
