"""Secrets are not where a run can read them: jwt_secret_file, and secrets passed by
environment variable removed from /proc/<server>/environ."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
import jwt
import pytest
from pydantic import ValidationError

from stargrpc.sandbox import decide
from stargrpc.secret_env import (
    HANDOVER_VARIABLE,
    read_handover,
    secret_variables,
    take_over,
    write_handover,
)
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.helpers import key_channel, run_tool
from tests.procs import ImageUser, serve

SECRET = "a-file-secret-that-is-long-enough-for-hs256-0123"
ISSUER, AUDIENCE = "https://idp.example", "stargrpc"
PG_PASSWORD = "pg-pass-7f3a9c"


def token(secret: str = SECRET) -> str:
    now = int(time.time())
    return jwt.encode({"sub": "user-1", "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                       "exp": now + 300, "roles": ["admin"]}, secret, algorithm="HS256")


def environ_of(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


# -- jwt_secret_file ------------------------------------------------------------------------

def test_jwt_secret_file_is_read_at_load_without_its_final_newline(tmp_path: Path) -> None:
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_text(SECRET + "\n")
    settings = Settings.load(jwt_secret_file=secret_file, jwt_issuer=ISSUER,
                             jwt_audience=AUDIENCE)
    assert settings.jwt_secret is not None
    assert settings.jwt_secret.get_secret_value() == SECRET
    shown = settings.masked()
    assert shown["jwt_secret"] == "***"
    assert shown["jwt_secret_file"] == str(secret_file)
    assert SECRET not in json.dumps(shown)


@pytest.mark.parametrize(("content", "extra", "message"), [
    (SECRET, {"jwt_secret": SECRET}, "give jwt_secret or jwt_secret_file, not both"),
    ("\n", {}, "is empty"),
    (None, {}, "cannot read the secret file"),
])
def test_jwt_secret_file_errors_are_clear(tmp_path: Path, content: str | None,
                                          extra: dict[str, str], message: str) -> None:
    secret_file = tmp_path / "jwt.secret"
    if content is not None:
        secret_file.write_text(content)
    with pytest.raises(ValidationError, match=message):
        Settings.load(jwt_secret_file=secret_file, jwt_issuer=ISSUER, jwt_audience=AUDIENCE,
                      **extra)


@pytest.mark.parametrize("setting", ["jwt_secret_file", "fleet_secret_file"])
def test_a_secret_file_every_user_may_write_is_refused(tmp_path: Path, setting: str) -> None:
    """Anyone able to write the JWT secret could sign any token with it; the fleet secret,
    vouch for any caller to a replica: such a file stops the server from starting."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o666)
    extra = {"jwt_issuer": ISSUER, "jwt_audience": AUDIENCE} if setting.startswith("jwt") else {}

    with pytest.raises(ValidationError, match="is writable by every user") as refused:
        Settings.load(**{setting: secret_file}, **extra)

    assert SECRET not in str(refused.value)
    secret_file.chmod(0o600)
    assert Settings.load(**{setting: secret_file}, **extra) is not None


async def test_tokens_signed_with_the_file_secret_are_accepted(make_auth_server,
                                                               tmp_path: Path) -> None:
    secret_file = tmp_path / "jwt.secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    auth = await make_auth_server(auth_registry(), jwt_secret_file=secret_file,
                                  jwt_issuer=ISSUER, jwt_audience=AUDIENCE)
    async with key_channel(auth.target, token()) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "user-1" in events[-1].result.output
    async with key_channel(auth.target, token("another-secret-long-enough-for-hs256-xx")
                           ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.skipif(decide(Settings.load()).isolation is None
                    or decide(Settings.load()).isolation.mode != "bwrap",  # type: ignore[union-attr]
                    reason="bubblewrap isolation is not available on this machine")
async def test_a_snippet_cannot_read_the_secret_file_or_the_server_environment(
        make_auth_server, tmp_path: Path) -> None:
    secret_file = tmp_path / "state" / "jwt.secret"
    secret_file.parent.mkdir(exist_ok=True)
    secret_file.write_text(SECRET)
    auth = await make_auth_server(jwt_secret_file=secret_file, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE)
    code = (f"import os\ntry:\n    print(open({str(secret_file)!r}).read())\n"
            "except OSError as exc:\n    print('file:', type(exc).__name__)\n"
            f"server = '/proc/{os.getpid()}/environ'\n"
            "print('environ:', os.path.exists(server))\n")
    async with key_channel(auth.target, auth.key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "python",
                                {"code": code})
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result.error
    assert "file: FileNotFoundError" in result.output
    assert "environ: False" in result.output
    assert SECRET not in result.output


# -- secrets passed by environment variable -------------------------------------------------

def test_secret_variables_are_the_secret_settings_and_urls_with_a_password() -> None:
    found = secret_variables({
        "STARGRPC_JWT_SECRET": "x" * 40,
        "STARGRPC_REDIS_URL": "redis://:hunter2@cache:6379/0",
        "STARGRPC_AUDIT_STORE": "postgresql://audit@db/audit",  # no password
        "STARGRPC_HOST": "0.0.0.0",
        "OTHER_TOKEN": "not ours",
    })
    assert sorted(found) == ["STARGRPC_JWT_SECRET", "STARGRPC_REDIS_URL"]


def test_a_handover_is_read_once_then_closed_and_forgotten(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fd = write_handover("stargrpc-test", {"key": "s3cr3t", "folder": tmp_path})
    monkeypatch.setenv("_STARGRPC_TEST_HANDOVER", str(fd))

    assert read_handover("_STARGRPC_TEST_HANDOVER") == {"key": "s3cr3t",
                                                         "folder": str(tmp_path)}
    assert "_STARGRPC_TEST_HANDOVER" not in os.environ
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the reader
    assert read_handover("_STARGRPC_TEST_HANDOVER") is None


def test_a_handover_that_is_no_open_file_is_no_secret(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    monkeypatch.setenv(HANDOVER_VARIABLE, "999999")
    assert take_over() == {}
    assert HANDOVER_VARIABLE not in os.environ


def test_serve_removes_secret_variables_from_proc_environ(tmp_path: Path) -> None:
    audit_url = f"postgresql://postgres:{PG_PASSWORD}@127.0.0.1:5432/test"
    with serve(tmp_path / "state", STARGRPC_INSECURE_NO_AUTH="false",
               STARGRPC_JWT_SECRET=SECRET, STARGRPC_JWT_ISSUER=ISSUER,
               STARGRPC_JWT_AUDIENCE=AUDIENCE, STARGRPC_AUDIT_STORE=audit_url) as server:
        environ = environ_of(server.proc.pid)  # the same process: exec keeps the pid
        assert "STARGRPC_JWT_ISSUER=" + ISSUER in environ
        assert SECRET not in environ and PG_PASSWORD not in environ
        assert "STARGRPC_JWT_SECRET" not in environ and "STARGRPC_AUDIT_STORE" not in environ
        removed = server.wait_for(
            lambda line: line.get("event") == "secrets_removed_from_environment", 5)
        assert removed["settings"] == ["audit_store", "jwt_secret"]
        # The secrets still reached the settings: a token signed with it is accepted.
        with grpc.insecure_channel(server.target) as channel:
            listed = tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_service_pb2.ListToolsRequest(), timeout=10,
                metadata=[("authorization", f"Bearer {token()}")])
        assert "echo" in {tool.name for tool in listed.tools}
        assert not any(SECRET in json.dumps(line) or PG_PASSWORD in json.dumps(line)
                       for line in server.lines)


def test_a_password_given_as_a_url_query_parameter_is_neither_logged_nor_left_in_environ(
        tmp_path: Path) -> None:
    # asyncpg, libpq and redis-py all take ?password=: it was logged in clear with the
    # settings at start-up and stayed in /proc/<server>/environ.
    audit_url = f"postgresql://postgres@127.0.0.1:5432/test?password={PG_PASSWORD}"
    with serve(tmp_path / "state", STARGRPC_AUDIT_STORE=audit_url) as server:
        environ = environ_of(server.proc.pid)
        assert PG_PASSWORD not in environ and "STARGRPC_AUDIT_STORE" not in environ
        settings = server.wait_for(lambda line: line.get("event") == "settings", 5)
        assert settings["audit_store"] == (
            "postgresql://postgres@127.0.0.1:5432/test?password=***")
        with grpc.insecure_channel(server.target) as channel:  # the store works
            listed = tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_service_pb2.ListToolsRequest(), timeout=10)
        assert "echo" in {tool.name for tool in listed.tools}
        assert not any(PG_PASSWORD in json.dumps(line) for line in server.lines)


def test_a_weakly_isolated_snippet_finds_no_secret_in_the_server_environment(
        image: ImageUser) -> None:
    """Even when the operator opts into rlimits (commands run as the server's user and
    can read /proc/<server>/environ), the variable is gone from it."""
    code = ("import os\nppid = os.getppid()\n"
            "data = open(f'/proc/{ppid}/environ', 'rb').read().decode(errors='replace')\n"
            "print('read', ppid, len(data) > 0)\n"
            f"print('secret' if {SECRET!r} in data else 'clean')\n")
    with serve(image.state_dir, prefix=image.prefix, **image.env,
               STARGRPC_SANDBOX_ALLOW_WEAK_ISOLATION="true", STARGRPC_JWT_SECRET=SECRET,
               STARGRPC_JWT_ISSUER=ISSUER, STARGRPC_JWT_AUDIENCE=AUDIENCE) as server:
        with grpc.insecure_channel(server.target) as channel:
            request = tool_service_pb2.ExecuteRequest(tool_name="python",
                                                      arguments_json=json.dumps({"code": code}))
            events = [r.event for r in tool_service_pb2_grpc.ToolServiceStub(channel).Execute(
                request, timeout=60)]
        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK, result.error
        assert f"read {server.proc.pid} True" in result.output
        assert "clean" in result.output and SECRET not in result.output


def test_a_handover_that_holds_no_object_of_names_is_no_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Valid JSON, but not the names and values this program hands over: no settings from
    # it, and no crash at start-up.
    for payload in ([1, 2], "text", 7, {"OTHER": "x", "STARGRPC_REDIS_URL": "redis://h"}):
        fd = write_handover("stargrpc-test", payload)
        monkeypatch.setenv(HANDOVER_VARIABLE, str(fd))
        taken = take_over()
        assert taken == ({"redis_url": "redis://h"} if isinstance(payload, dict) else {})
        assert HANDOVER_VARIABLE not in os.environ
