"""``stargrpc keys`` (in process, through click) and the first-start admin key of
``stargrpc serve`` (a child process, a real server, real calls)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner, Result

from stargrpc.auth import bootstrap_admin_key
from stargrpc.cli import main
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import key_channel, run_tool
from tests.procs import ServerProcess


def stargrpc(*args: str, state_dir: Path) -> Result:
    return CliRunner().invoke(main, list(args), env={"STARGRPC_STATE_DIR": str(state_dir),
                                                     "STARGRPC_KEYS_FILE": None})


def test_create_prints_the_key_once_on_the_last_line_then_list_and_revoke(
        tmp_path: Path) -> None:
    keys_file = tmp_path / "elsewhere" / "keys.json"

    created = stargrpc("keys", "create", "--name", "ci-bot", "--role", "ops", "--role",
                       "reader", "--keys-file", str(keys_file), state_dir=tmp_path)
    listed = stargrpc("keys", "list", "--json", "--keys-file", str(keys_file),
                      state_dir=tmp_path)
    revoked = stargrpc("keys", "revoke", "ci-bot", "--keys-file", str(keys_file),
                       state_dir=tmp_path)
    again = stargrpc("keys", "revoke", "ci-bot", "--keys-file", str(keys_file),
                     state_dir=tmp_path)
    table = stargrpc("keys", "list", "--keys-file", str(keys_file), state_dir=tmp_path)

    assert created.exit_code == 0, created.output
    key = created.stdout.splitlines()[-1]
    assert key.startswith("sgk_") and key.strip() == key
    assert key not in keys_file.read_text()
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["name"], row["roles"], row["revoked_at"]) == ("ci-bot", ["ops", "reader"], None)
    assert "hash" not in row and row["id"] in key
    assert revoked.exit_code == 0 and row["id"] in revoked.stdout
    assert again.exit_code == 1 and "no live key" in again.stderr
    assert "revoked" in table.stdout and key not in table.stdout


def test_keys_default_to_the_state_folder_and_refuse_bad_input(tmp_path: Path) -> None:
    created = stargrpc("keys", "create", "--name", "alice", state_dir=tmp_path)
    duplicate = stargrpc("keys", "create", "--name", "alice", state_dir=tmp_path)
    bad_role = stargrpc("keys", "create", "--name", "bob", "--role", "a b", state_dir=tmp_path)

    assert created.exit_code == 0
    assert (tmp_path / "keys.json").exists()
    assert duplicate.exit_code == 2 and "live key named 'alice'" in duplicate.stderr
    assert bad_role.exit_code == 2 and "bad role" in bad_role.stderr


def test_no_first_key_when_keys_exist_or_another_identity_source_is_configured(
        tmp_path: Path) -> None:
    base = {"state_dir": tmp_path}
    assert bootstrap_admin_key(Settings(**base, insecure_no_auth=True)) is None
    assert bootstrap_admin_key(Settings(**base, auth_bootstrap_key=False)) is None
    assert bootstrap_admin_key(Settings(**base, jwt_secret="s" * 32, jwt_issuer="i",
                                        jwt_audience="a")) is None
    created = bootstrap_admin_key(Settings(**base))
    assert created is not None and created[0].roles == ("admin", "privileged")
    assert bootstrap_admin_key(Settings(**base)) is None  # the second start makes none


def serve_with_auth(state_dir: Path) -> ServerProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STARGRPC_")}
    env.update({"STARGRPC_STATE_DIR": str(state_dir), "STARGRPC_SHUTDOWN_GRACE_SECONDS": "5"})
    return ServerProcess([], env)


def printed_keys(server: ServerProcess) -> list[str]:
    return [str(line["text"]) for line in server.lines
            if line.get("event") == "raw" and str(line.get("text", "")).startswith("sgk_")]


async def echo(target: str, key: str) -> events_pb2.RunEvent:
    async with key_channel(target, key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "echo",
                                {"text": "hi"})
    return events[-1]


async def test_serve_makes_one_admin_key_on_first_start_and_prints_it_once(
        tmp_path: Path) -> None:
    server = serve_with_auth(tmp_path)
    try:
        [key] = printed_keys(server)
        assert (await echo(server.target, key)).result.outcome == events_pb2.OUTCOME_OK
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await echo(server.target, "sgk_" + "0" * 12 + "_" + "A" * 43)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert server.stop() == 0
    assert key not in (tmp_path / "keys.json").read_text()
    assert not any(key in json.dumps(line) for line in server.lines
                   if line.get("event") != "raw")  # never in a log record


def test_keys_read_the_keys_file_from_the_server_config(tmp_path: Path) -> None:
    config = tmp_path / "stargrpc.toml"
    config.write_text(f'keys_file = "{tmp_path / "from-config.json"}"\n')

    created = stargrpc("keys", "create", "--name", "ci", "--config", str(config),
                       state_dir=tmp_path / "state")

    assert created.exit_code == 0, created.output
    assert "ci" in (tmp_path / "from-config.json").read_text()
