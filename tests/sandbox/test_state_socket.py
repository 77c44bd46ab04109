"""Sandboxed runs reach their own run's and tree's state through the state socket
(sandbox/state_socket.py), in every isolation mode this machine runs: the python module and
the stargrpc-state command work; and every attack from inside a run is refused with its
code while the socket goes on serving: another run's or principal's state, hand-made and
hostile frames, floods, stolen or guessed descriptors."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.sandbox.isolation import MODES, probe
from stargrpc.sandbox.runner import sandbox_ids, sandbox_root
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool
from tests.runs_support import HeaderPrincipal, as_principal
from tests.sandbox.state_socket_helpers import RAW_CLIENT

LIMITS = {"sandbox_cpu_seconds": 5, "sandbox_memory_mb": 256, "sandbox_wall_clock_seconds": 60}


def _working_modes() -> list[str]:
    settings = Settings.load(insecure_no_auth=True)
    uid, gid = sandbox_ids(settings)
    return [mode for mode in MODES if probe(mode, sandbox_root(settings), uid, gid) is None]


WORKING = _working_modes()


async def _server(make_server: Any, **settings: Any) -> tuple[Any, Any]:
    server = await make_server(**{**LIMITS, **settings})
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, tool_service_pb2_grpc.ToolServiceStub(channel)


async def _python(stub: Any, code: str) -> tuple[str, Any]:
    """Runs ``code`` (which prints one JSON line last) in the python tool; the run id and
    that line."""
    events = await run_tool(stub, "python", {"code": code})
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.output
    return events[0].run_id, json.loads(result.output.split("\n[exited")[0].splitlines()[-1])


@pytest.mark.parametrize("mode", WORKING)
async def test_a_python_snippet_keeps_run_and_tree_state(make_server, mode: str) -> None:
    server, stub = await _server(make_server, sandbox_isolation=mode,
                                 sandbox_allow_weak_isolation=True)
    code = """
import json, stargrpc_state
run, tree = stargrpc_state.state("run"), stargrpc_state.state("tree")
run.set("n", {"a": [1, 2]})
assert tree.compare_and_set("lock", None, "mine") is True
assert tree.compare_and_set("lock", None, "theirs") is False
print(json.dumps({"n": run.get("n"), "missing": run.get("nope", "dflt"),
                  "hits": [tree.increment("hits"), tree.increment("hits", 5)],
                  "keys": tree.keys(), "deleted": [run.delete("n"), run.delete("n")]}))
"""
    run_id, seen = await _python(stub, code)
    assert seen == {"n": {"a": [1, 2]}, "missing": "dflt", "hits": [1, 6],
                    "keys": ["hits", "lock"], "deleted": [True, False]}
    # The server's store holds it under this run's tree (a top-level run is its own root).
    store = server.runtime.state_store
    assert await store.keys(f"tree:{run_id}", "") == ["hits", "lock"]
    assert await store.get(f"tree:{run_id}", "lock") == '"mine"'


@pytest.mark.parametrize("mode", WORKING)
async def test_the_shell_command_reads_and_writes_state(make_server, mode: str) -> None:
    _, stub = await _server(make_server, sandbox_isolation=mode,
                            sandbox_allow_weak_isolation=True)
    command = """
stargrpc-state set greeting '"hi"' --ttl 60
stargrpc-state get greeting
stargrpc-state get absent; echo "absent:$?"
stargrpc-state --scope tree incr n 41; stargrpc-state --scope tree incr n
stargrpc-state cas greeting '"hi"' '"bye"'; stargrpc-state cas greeting '"hi"' 1; echo "cas:$?"
stargrpc-state keys
stargrpc-state delete greeting
stargrpc-state set 'bad/key' 1; echo "bad:$?"
stargrpc-state --scope principal get x; echo "principal:$?"
"""
    events = await run_tool(stub, "shell", {"command": command})
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.output
    lines = result.output.split("[stderr]")[0].split()
    assert lines == ['"hi"', "absent:3", "41", "42", "true", "false", "cas:1", "greeting",
                     "true", "bad:2", "principal:2"]
    stderr = result.output.split("[stderr]")[1]
    assert "STATE_BAD_KEY" in stderr and "STATE_SCOPE_NOT_OFFERED" in stderr


async def test_runs_never_see_each_others_run_state_and_a_request_names_no_run(
        make_server) -> None:
    _, stub = await _server(make_server)
    _, mine = await _python(stub, "import json, stargrpc_state as s\n"
                                "s.state('run').set('secret', 'A')\n"
                                "s.state('tree').set('secret', 'A')\n"
                                "print(json.dumps(s.state('run').keys()))")
    assert mine == ["secret"]
    code = RAW_CLIENT + """
import json, stargrpc_state as s
answers = [ask({"op": "get", "key": "secret", "run_id": %(other)r}),
           ask({"op": "get", "key": "secret", "scope": "run", "principal": "someone"}),
           ask({"op": "get", "key": "secret", "scope": "tree", "root_run_id": %(other)r}),
           ask({"op": "get", "key": "secret", "scope": "run:" + %(other)r}),
           ask({"op": "get", "key": "secret", "scope": "principal"}),
           ask({"op": "get", "key": "secret", "scope": "global"})]
print(json.dumps({"codes": [a.get("code") for a in answers],
                  "run": s.state("run").keys(), "tree": s.state("tree").keys()}))
"""
    _, seen = await _python(stub, code % {"other": "run-of-someone-else"})
    assert seen == {"codes": ["STATE_BAD_REQUEST", "STATE_BAD_REQUEST", "STATE_BAD_REQUEST",
                              "STATE_BAD_SCOPE", "STATE_SCOPE_NOT_OFFERED",
                              "STATE_SCOPE_NOT_OFFERED"],
                    "run": [], "tree": []}


async def test_principal_and_global_when_the_operator_offers_them(make_server) -> None:
    _, stub = await _server(make_server, sandbox_state_scopes="run,tree,principal,global")
    code = """
import json, stargrpc_state as s
s.state("principal").set("seen", 1)
try:
    s.state("global").set("x", 1)
    code = None
except s.StateError as exc:
    code = exc.code
print(json.dumps({"principal": s.state("principal").get("seen"), "global": code}))
"""
    _, seen = await _python(stub, code)
    assert seen == {"principal": 1, "global": "STATE_READ_ONLY"}


HOSTILE = {
    "not JSON": (b"this is not json\n", "STATE_BAD_REQUEST"),
    "not UTF-8": (b"\xff\xfe{}\n", "STATE_BAD_REQUEST"),
    "not an object": (b"[1, 2]\n", "STATE_BAD_REQUEST"),
    "no op": (b'{"key": "k"}\n', "STATE_BAD_REQUEST"),
    "unknown op": (b'{"op": "flushall"}\n', "STATE_BAD_REQUEST"),
    "missing key": (b'{"op": "set", "value": 1}\n', "STATE_BAD_REQUEST"),
    "key not a string": (b'{"op": "get", "key": 5}\n', "STATE_BAD_KEY"),
    "key with a separator": (b'{"op": "get", "key": "a:b"}\n', "STATE_BAD_KEY"),
    "key with a slash": (b'{"op": "get", "key": "../run"}\n', "STATE_BAD_KEY"),
    "key with a NUL": (b'{"op": "get", "key": "a\\u0000b"}\n', "STATE_BAD_KEY"),
    "key with a newline": (b'{"op": "set", "key": "a\\nb", "value": 1}\n', "STATE_BAD_KEY"),
    "key too long": (b'{"op": "get", "key": "' + b"k" * 201 + b'"}\n', "STATE_BAD_KEY"),
    "NaN value": (b'{"op": "set", "key": "k", "value": NaN}\n', "STATE_VALUE_NOT_JSON"),
    "value too large": (b'{"op": "set", "key": "k", "value": "' + b"x" * 2000 + b'"}\n',
                        "STATE_VALUE_TOO_LARGE"),
    "bad ttl": (b'{"op": "set", "key": "k", "value": 1, "ttl": "soon"}\n',
                "STATE_BAD_REQUEST"),
    "negative ttl": (b'{"op": "set", "key": "k", "value": 1, "ttl": -1}\n', "STATE_BAD_SCOPE"),
    "fractional step": (b'{"op": "incr", "key": "k", "by": 1.5}\n', "STATE_NOT_INTEGER"),
    "deep nesting": (b'{"op": "set", "key": "k", "value": ' + b"[" * 5000 + b"]" * 5000
                     + b"}\n", "STATE_BAD_REQUEST"),
    "huge integer": (b'{"op": "incr", "key": "k", "by": 1' + b"0" * 5000 + b"}\n",
                     "STATE_BAD_REQUEST"),
}


async def test_hostile_frames_are_each_refused_with_its_code(make_server, log_lines) -> None:
    _, stub = await _server(make_server, state_max_value_bytes=1024)
    code = RAW_CLIENT + """
import json
frames = json.loads(%(frames)r)
codes = [raw(frame.encode("latin-1")).get("code") for frame in frames]
# One line larger than the socket takes: refused, then that conversation is closed.
big = raw(b'{"op": "set", "key": "k", "value": "' + b"x" * (8 * 1024 * 1024) + b'"}\\n')
print(json.dumps({"codes": codes, "big": big.get("code"),
                  "after": ask({"op": "set", "key": "ok", "value": 1})}))
"""
    frames = [frame.decode("latin-1") for frame, _ in HOSTILE.values()]
    _, seen = await _python(stub, code % {"frames": json.dumps(frames)})
    assert dict(zip(HOSTILE, seen["codes"], strict=True)) == {
        name: expected for name, (_, expected) in HOSTILE.items()}
    assert seen["big"] == "STATE_REQUEST_TOO_LARGE"
    assert seen["after"] == {"ok": True}
    # The refusals are counted in one log line with the run's id, when the run ends.
    [counted] = [line for line in map(json.loads, log_lines.getvalue().splitlines())
                 if line["event"] == "state_socket_refusals"]
    expected: dict[str, int] = {}
    for _, code in [*HOSTILE.values(), (b"", "STATE_REQUEST_TOO_LARGE")]:
        expected[code] = expected.get(code, 0) + 1
    assert counted["refusals"] == expected and counted["run_id"]


async def test_a_flood_is_rate_limited_and_the_socket_serves_again(make_server) -> None:
    _, stub = await _server(make_server, sandbox_state_requests_per_second=20)
    code = RAW_CLIENT + """
import json, time
codes = [ask({"op": "get", "key": "k"}).get("code") for _ in range(200)]
time.sleep(1.0)  # the bucket (20 a second) fills again
# Conversations: the shared one and seven more are served, a ninth at once is refused.
held = [connect() for _ in range(7)]
answers = [exchange(conversation, {"op": "keys"}) for conversation in held]
ninth = exchange(connect(), {"op": "keys"})
print(json.dumps({"limited": codes.count("STATE_RATE_LIMITED"), "served": codes.count(None),
                  "conversations": answers, "ninth": ninth,
                  "after": ask({"op": "incr", "key": "n"})}))
"""
    _, seen = await _python(stub, code)
    assert seen["limited"] >= 150 and seen["served"] >= 1
    assert seen["limited"] + seen["served"] == 200
    assert seen["conversations"] == [{"ok": True, "value": []}] * 7
    assert seen["ninth"]["code"] == "STATE_RATE_LIMITED"
    assert "connections open at once" in seen["ninth"]["message"]
    assert seen["after"] == {"ok": True, "value": 1}


async def test_descriptors_that_are_not_a_fresh_socket_pair_are_not_served(
        make_server) -> None:
    _, stub = await _server(make_server)
    code = RAW_CLIENT + """
import array, json, os, socket
broker = socket.socket(fileno=os.dup(int(os.environ["STARGRPC_STATE_FD"])))
def hand(fd):
    broker.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
# A pipe, a file, a datagram socket pair, and two descriptors in one message.
read_end, write_end = os.pipe()
hand(write_end)
hand(os.open("snippet.py", os.O_RDONLY))
dgram, dgram_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
hand(dgram_peer.fileno())
one, one_peer = socket.socketpair()
two, two_peer = socket.socketpair()
broker.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                         array.array("i", [two_peer.fileno(), one_peer.fileno()]))])
broker.send(b"")  # an empty message opens nothing either
for s in (one_peer, two_peer):
    s.close()
os.close(write_end)
two.settimeout(30)
two.sendall(b'{"op":"keys"}\\n')
answer_two = two.recv(100).decode()
try:
    one.sendall(b'{"op":"keys"}\\n')
    answer_one = one.recv(100).decode()
except OSError as exc:  # its peer is gone: nobody serves it
    answer_one = type(exc).__name__
print(json.dumps({"pipe": os.read(read_end, 100).decode(), "two": answer_two,
                  "one": answer_one, "after": ask({"op": "keys"})}))
"""
    _, seen = await _python(stub, code)
    # Only the first descriptor of a message is taken: the other one is closed unanswered.
    assert seen["pipe"] == ""
    assert json.loads(seen["two"]) == {"ok": True, "value": []}
    assert seen["one"] in ("", "BrokenPipeError", "ConnectionResetError")
    assert seen["after"] == {"ok": True, "value": []}


@pytest.mark.skipif("unshare" not in WORKING and "bwrap" not in WORKING,
                    reason="needs a PID namespace (bwrap or unshare)")
async def test_a_run_finds_no_state_socket_but_its_own(make_server) -> None:
    """Guessing: every descriptor number, every process the run can see (whose descriptors
    pidfd_getfd could take): the only state socket a run can reach is its own."""
    _, stub = await _server(make_server, sandbox_isolation="unshare"
                            if "unshare" in WORKING else "bwrap")
    # A second run holds its socket open meanwhile: it must be out of sight.
    code = """
import json, os, socket
sockets = []
for fd in range(3, 1024):
    try:
        sockets.append([fd, socket.socket(fileno=os.dup(fd)).type.name])
    except OSError:
        pass
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps({"sockets": sockets, "mine": int(os.environ["STARGRPC_STATE_FD"]),
                  "pids": pids, "me": os.getpid()}))
"""
    _, seen = await _python(stub, code)
    assert seen["sockets"] == [[seen["mine"], "SOCK_SEQPACKET"]]
    # A PID namespace of its own: no other run's process to take a descriptor from.
    assert seen["pids"] == [seen["me"]]


async def test_no_socket_when_the_operator_offers_no_scope(make_server) -> None:
    _, stub = await _server(make_server, sandbox_state_scopes="")
    code = """
import json, os
try:
    import stargrpc_state
    found = "importable"
except ImportError:
    found = "absent"
print(json.dumps({"fd": os.environ.get("STARGRPC_STATE_FD"), "module": found}))
"""
    _, seen = await _python(stub, code)
    assert seen == {"fd": None, "module": "absent"}


async def test_the_principal_scope_is_the_callers_own(make_server) -> None:
    """With principal offered, a snippet reaches its caller's state, never another's."""
    server = await make_server(interceptors=[HeaderPrincipal()], **LIMITS,
                               sandbox_state_scopes="run,tree,principal")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = tool_service_pb2_grpc.ToolServiceStub(channel)

    async def snippet(principal: str, code: str) -> Any:
        request = tool_service_pb2.ExecuteRequest(tool_name="python",
                                                  arguments_json=json.dumps({"code": code}))
        events = [r.event async for r in stub.Execute(request,
                                                      metadata=as_principal(principal))]
        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK, result.output
        return json.loads(result.output.split("\n[exited")[0].splitlines()[-1])

    write = ("import json, stargrpc_state as s\ns.state('principal').set('secret', 'of-alice')"
             "\nprint(json.dumps(s.state('principal').keys()))")
    assert await snippet("alice", write) == ["secret"]
    read = ("import json, stargrpc_state as s\n"
            "print(json.dumps([s.state('principal').keys(), "
            "s.state('principal').get('secret')]))")
    assert await snippet("bob", read) == [[], None]
    assert await snippet("alice", read) == [["secret"], "of-alice"]
    await channel.close()


async def test_a_fleet_serves_the_socket_from_redis(make_server) -> None:
    """On a fleet's store, what a snippet keeps is in Redis, where another replica reads
    it."""
    prefix = f"stargrpc-test:{uuid.uuid4().hex[:12]}:"
    client = Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        replicas = [await make_server(**LIMITS, redis_url="redis://127.0.0.1:6379/0",
                                      redis_key_prefix=prefix) for _ in range(2)]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{replicas[0].port}")
        run_id, seen = await _python(tool_service_pb2_grpc.ToolServiceStub(channel),
                                     "import json, stargrpc_state as s\n"
                                     "print(json.dumps(s.state('tree').increment('n', 41)))")
        await channel.close()
        assert seen == 41
        other = replicas[1].runtime.state_store
        assert await other.get(f"tree:{run_id}", "n") == "41"
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await client.aclose()
