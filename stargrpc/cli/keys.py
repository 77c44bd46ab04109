"""``stargrpc keys``: create, list and revoke API keys in the keys file.

A key is printed once, alone on the last line of ``keys create`` (so ``| tail -1`` captures
it); the file keeps only its hash. A running server sees changes on its next call.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from stargrpc.auth import ApiKey, KeyStore, bootstrap_admin_key, keys_path
from stargrpc.errors import KeysFileError
from stargrpc.settings import Settings


def _keys_file_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--keys-file", "keys_file", type=click.Path(path_type=Path), default=None,
        help="The keys file [env STARGRPC_KEYS_FILE; default <state_dir>/keys.json].")(fn)
    return click.option(
        "--config", "config_file", type=click.Path(path_type=Path, exists=True), default=None,
        help="The server's TOML settings file, for its keys_file or state_dir "
        "[env STARGRPC_CONFIG].")(fn)


def _store(keys_file: Path | None, config_file: Path | None) -> KeyStore:
    try:
        settings = Settings.load(config_file, keys_file=keys_file)
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings:\n{exc}") from exc
    return KeyStore(keys_path(settings))


def _fail(exc: KeysFileError) -> None:
    click.echo(f"stargrpc keys: {exc}", err=True)
    sys.exit(2)


@click.group()
def keys() -> None:
    """Manage API keys (stored as hashes; a key is shown only when created)."""


@keys.command()
@click.option("--name", required=True, help="Who the key is for: the principal id it "
              "authenticates as.")
@click.option("--role", "roles", multiple=True, help="A role to grant (repeatable).")
@_keys_file_option
def create(name: str, roles: tuple[str, ...], keys_file: Path | None,
           config_file: Path | None) -> None:
    """Create a key and print it once, alone on the last line."""
    store = _store(keys_file, config_file)
    try:
        record, key = store.create(name, roles)
    except KeysFileError as exc:
        _fail(exc)
        return
    click.echo(f"created key {record.id} for {record.name!r} with roles "
               f"{', '.join(record.roles) or '(none)'} in {store.path}")
    click.echo("it is shown only now; send it as the header 'authorization: Bearer <key>':")
    click.echo(key)


@keys.command(name="list")
@_keys_file_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key.")
def list_keys(keys_file: Path | None, config_file: Path | None, as_json: bool) -> None:
    """List keys (never the keys themselves: they are not stored)."""
    store = _store(keys_file, config_file)
    try:
        records = store.records()
    except KeysFileError as exc:
        _fail(exc)
        return
    for record in records:
        if as_json:
            click.echo(json.dumps(record.model_dump(mode="json", exclude={"hash"})))
        else:
            click.echo(_row(record))
    if not records and not as_json:
        click.echo(f"no keys in {store.path}", err=True)


def _row(record: ApiKey) -> str:
    status = (f"revoked {record.revoked_at:%Y-%m-%d %H:%M}Z" if record.revoked_at
              else "live")
    return (f"{record.id}  {record.name:<20}  {','.join(record.roles) or '-':<24}  "
            f"created {record.created_at:%Y-%m-%d %H:%M}Z  {status}")


@keys.command()
@click.argument("name_or_id")
@_keys_file_option
def revoke(name_or_id: str, keys_file: Path | None, config_file: Path | None) -> None:
    """Revoke the live key(s) with this name or id; exits 1 when none matched."""
    store = _store(keys_file, config_file)
    try:
        revoked = store.revoke(name_or_id)
    except KeysFileError as exc:
        _fail(exc)
        return
    if not revoked:
        click.echo(f"no live key named or with id {name_or_id!r}", err=True)
        sys.exit(1)
    for record in revoked:
        click.echo(f"revoked key {record.id} of {record.name!r}")


def announce_first_key(settings: Settings) -> None:
    """For ``serve``: creates the first admin key when there is none and prints it once (to
    standard error, away from the JSON log lines), the key alone on the last line.

    Raises:
        KeysFileError: The keys file cannot be read or written.
    """
    created = bootstrap_admin_key(settings)
    if created is None:
        return
    record, key = created
    click.echo(
        f"stargrpc: no API keys were configured, so one was created: {record.id} for "
        f"{record.name!r} with roles {', '.join(record.roles)}.\n"
        f"stargrpc: only its hash is stored (in {keys_path(settings)}); the key is shown "
        "only now. Send it as 'authorization: Bearer <key>':", err=True)
    click.echo(key, err=True)
