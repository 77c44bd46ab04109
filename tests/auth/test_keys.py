"""The API keys file: hashes only, constant-time checks, revocation, safe concurrent edits."""

from __future__ import annotations

import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stargrpc.auth.keys import KEY_PREFIX, KeyStore, digest
from stargrpc.errors import CredentialsRejected, KeysFileError
from tests.auth.helpers import whoami
from tests.auth_tools import auth_registry


def cause_of(store: KeyStore, key: str) -> str:
    with pytest.raises(CredentialsRejected) as caught:
        store.verify(key)
    return caught.value.cause


def test_a_key_is_stored_only_as_its_hash(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "state" / "keys.json")

    record, key = store.create("ci-bot", ["ops", "ops", "reader"])

    text = store.path.read_text()
    assert key.startswith(KEY_PREFIX) and len(key) > 50
    # sgk_<id>_<secret>; the secret is URL-safe base64, which may itself contain "_".
    secret = key.removeprefix(KEY_PREFIX).split("_", 1)[1]
    assert key not in text and secret not in text
    assert json.loads(text)["keys"][0]["hash"] == digest(key) == record.hash
    assert record.roles == ("ops", "reader")
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    assert store.verify(key) == record


def test_wrong_unknown_malformed_and_revoked_keys_are_refused(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    _, key = store.create("alice", ["admin"])
    key_id = key.split("_")[1]

    assert cause_of(store, key[:-1] + ("A" if key[-1] != "A" else "B")) == "unknown_key"
    assert cause_of(store, f"{KEY_PREFIX}{'0' * 12}_{key.split('_', 2)[2]}") == "unknown_key"
    assert cause_of(store, "sgk_short") == "malformed_key"
    assert [k.id for k in store.revoke(key_id)] == [key_id]
    assert cause_of(store, key) == "revoked_key"
    assert store.revoke("alice") == []  # nothing live is left to revoke


def test_a_live_name_is_unique_until_revoked(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    store.create("alice", [])

    with pytest.raises(KeysFileError, match="live key named 'alice'"):
        store.create("alice", [])
    store.revoke("alice")
    _, again = store.create("alice", ["reader"])

    assert store.verify(again).roles == ("reader",)
    assert [(k.name, k.revoked) for k in store.records()] == [("alice", True), ("alice", False)]


@pytest.mark.parametrize(("name", "roles"), [("", []), ("has space", []), ("-x", []),
                                             ("ok", ["*"]), ("ok", ["a b"])])
def test_bad_names_and_roles_are_refused(tmp_path: Path, name: str, roles: list[str]) -> None:
    with pytest.raises(KeysFileError, match="bad"):
        KeyStore(tmp_path / "keys.json").create(name, roles)


def test_a_broken_file_is_named_and_the_last_good_copy_keeps_serving(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    serving = KeyStore(path)
    _, key = serving.create("alice", [])
    assert serving.verify(key).name == "alice"

    path.write_text("{not json")

    with pytest.raises(KeysFileError, match=str(path)):
        KeyStore(path).records()
    assert serving.verify(key).name == "alice"
    assert cause_of(KeyStore(path), key) == "keys_unavailable"


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"

    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda n: KeyStore(path).create(f"k{n}", [])[1], range(16)))

    store = KeyStore(path)
    assert sorted(k.name for k in store.records()) == sorted(f"k{n}" for n in range(16))
    assert all(store.verify(key) for key in keys)


def test_the_first_key_is_made_once(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")

    first = store.create_first("admin", ["admin"])
    assert first is not None
    store.revoke("admin")

    assert store.create_first("admin", ["admin"]) is None  # revoked keys still count


async def test_a_server_does_not_start_with_a_broken_keys_file(make_server, tmp_path) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text('{"version": 1, "keys": [{"id": 1}]}')

    with pytest.raises(KeysFileError, match="malformed"):
        await make_server(insecure_no_auth=False, keys_file=keys_file)


async def test_a_keys_file_others_may_write_is_refused(make_server, tmp_path) -> None:
    keys_file = tmp_path / "keys.json"
    KeyStore(keys_file).create("alice", ["admin"])
    keys_file.chmod(0o666)

    with pytest.raises(KeysFileError, match="writable by every user"):
        await make_server(insecure_no_auth=False, keys_file=keys_file)
    with pytest.raises(KeysFileError, match="writable by every user"):
        KeyStore(keys_file).create("bob", [])  # no command launders what another wrote


async def test_a_key_written_into_a_keys_file_others_may_write_is_refused(
        make_auth_server, tmp_path) -> None:
    auth = await make_auth_server(auth_registry())
    assert await whoami(auth.target, auth.key) == "tester api_key admin"
    _, intruder = KeyStore(tmp_path / "elsewhere.json").create("intruder", ["admin"])
    added = json.loads((tmp_path / "elsewhere.json").read_text())["keys"]

    # Another user of the machine may write the file: they add a key of their own, in place.
    auth.keys.path.chmod(0o666)
    data = json.loads(auth.keys.path.read_text())
    data["keys"] += added
    with auth.keys.path.open("w") as out:
        out.write(json.dumps(data))

    assert await whoami(auth.target, intruder) == "UNAUTHENTICATED"
    assert await whoami(auth.target, auth.key) == "tester api_key admin"  # the last good set


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_keys_file_of_another_user_is_refused(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    _, key = KeyStore(keys_file).create("alice", ["admin"])
    os.chown(keys_file, 65534, 65534)

    with pytest.raises(KeysFileError, match="belongs to another user"):
        KeyStore(keys_file).records()
    assert cause_of(KeyStore(keys_file), key) == "keys_unavailable"


def test_a_key_cannot_be_named_as_another_key_is_identified(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.json")
    alice, _ = store.create("alice", ["admin"])

    # Named so, `keys revoke <alice's id>` would revoke that key as well as alice's.
    with pytest.raises(KeysFileError, match="12 hex digits are a key id"):
        store.create(alice.id, ["reader"])
    assert [k.name for k in store.revoke(alice.id)] == ["alice"]
    assert store.create("0123456789abcdef", [])[0].name == "0123456789abcdef"  # not an id
