"""``stargrpc audit verify|anchor|tail|query``: read and check the audit trail.

The store is the one the server writes (``--store``, else ``STARGRPC_AUDIT_STORE``, else
``audit_store`` from the settings file, else ``sqlite:///<state_dir>/audit.db``); the audit
key is the server's too (``--key-file``, else ``audit_hmac_key_file``, else the default
``audit-hmac.key`` beside a SQLite trail named by ``--store`` or in ``<state_dir>``, the
first that exists).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from stargrpc.audit.chain import Anchor, VerifyReport
from stargrpc.audit.chain import verify as verify_chain
from stargrpc.audit.key import AuditKeyError, ChainKey, default_key_path, load_key
from stargrpc.audit.record import OUTCOMES, AuditRecord, format_time
from stargrpc.audit.sqlite import SqliteAuditStore
from stargrpc.audit.store import AuditStore, Query, audit_store_url, open_store, sqlite_path
from stargrpc.settings import Settings, mask_url

#: Exit status of ``audit verify`` when the chain is broken.
EXIT_BROKEN = 1
#: Exit status when the store cannot be read.
EXIT_NO_STORE = 2

_F = TypeVar("_F", bound=Callable[..., Any])

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def _store_options(command: _F) -> _F:
    command = click.option("--config", "config_file", default=None,
                           type=click.Path(path_type=Path, exists=True),
                           help="A TOML settings file [env STARGRPC_CONFIG].")(command)
    return click.option("--store", "store_url", default=None,
                        help="sqlite:///PATH or postgresql://… [env STARGRPC_AUDIT_STORE; "
                        "default sqlite:///<state_dir>/audit.db].")(command)


def _settings(config_file: Path | None) -> Settings:
    try:
        return Settings.load(config_file)
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings:\n{exc}") from exc


def _resolve_url(store_url: str | None, config_file: Path | None) -> str:
    if store_url:
        return store_url
    settings = _settings(config_file)
    return audit_store_url(settings)


def _keys(key_files: tuple[Path, ...], config_file: Path | None,
          store_url: str | None = None) -> list[ChainKey]:
    """The keys given, else the server's key when its file exists (for a SQLite trail
    named by ``--store``, also the default key file beside it: a state folder holds
    both); exits 2 when a key file cannot be read."""
    paths = list(key_files)
    if not paths:
        settings = _settings(config_file)
        configured = settings.audit_hmac_key_file
        candidates = [default_key_path(settings.state_dir)]
        if store_url and store_url.startswith("sqlite:"):
            with contextlib.suppress(ValueError):
                candidates.insert(0, default_key_path(sqlite_path(store_url).parent))
        found = [path for path in candidates if path.exists()][:1]
        paths = [configured] if configured is not None else found
    try:
        return [load_key(path) for path in paths]
    except AuditKeyError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_NO_STORE)


def _anchors(values: tuple[str, ...]) -> list[Anchor]:
    """``--anchor`` values: ``HASH:COUNT``, or a file of such lines."""
    anchors: list[Anchor] = []
    for value in values:
        path = Path(value)
        lines = [value]
        if path.is_file():
            lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
        try:
            anchors.extend(Anchor.parse(line) for line in lines)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--anchor") from exc
    return anchors


def _key_options(command: _F) -> _F:
    return click.option("--key-file", "key_files", multiple=True,
                        type=click.Path(path_type=Path, exists=True, dir_okay=False),
                        help="An audit key file (repeat for records written with other "
                        "keys) [default: audit_hmac_key_file, else audit-hmac.key beside the "
                        "--store SQLite file or in <state_dir>, if it exists].")(command)


def _run(store_url: str | None, config_file: Path | None,
         work: Callable[[AuditStore], Any]) -> Any:
    """Opens the store, runs ``work`` with it, closes it; exits 2 if it cannot be read."""
    url = _resolve_url(store_url, config_file)
    try:
        store = open_store(url)
        if isinstance(store, SqliteAuditStore):
            if not sqlite_path(url).exists():
                raise FileNotFoundError(f"no audit database at {sqlite_path(url)}")
            # These commands only read: the file, its mode and its folder stay as they are.
            store = SqliteAuditStore(url, read_only=True)
    except (ValueError, FileNotFoundError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_NO_STORE)

    async def main() -> Any:
        try:
            await store.open()
        except Exception as exc:
            click.echo(f"error: cannot open the audit store {mask_url(url)}: {exc}", err=True)
            sys.exit(EXIT_NO_STORE)
        try:
            return await work(store)
        finally:
            await store.aclose()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return None


def parse_since(value: str) -> str:
    """``--since``: an ISO 8601 time (UTC unless it says otherwise) or an age such as
    ``90s``, ``15m``, ``2h``, ``7d``, in the store's time format.

    Raises:
        click.BadParameter: Neither.
    """
    match = _RELATIVE.match(value)
    if match:
        age = timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
        return format_time(datetime.now(UTC) - age)
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter("use an ISO 8601 time (2026-01-31T12:00:00Z) or an age "
                                 "such as 15m, 2h or 7d") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return format_time(moment)


def format_record(record: AuditRecord) -> str:
    """One record on one line, for people."""
    method = record.method.rsplit("/", 1)[-1]
    parts = [record.time, f"#{record.seq}", record.outcome.ljust(15), record.who or "-",
             method]
    if record.tool:
        parts.append(record.tool + (" [privileged]" if record.privileged else ""))
    if record.run_id:
        parts.append(f"run={record.run_id}")
    if record.parent_run_id:
        parts.append(f"parent={record.parent_run_id}")
    parts.append(f"{record.duration_ms:.1f}ms")
    if record.usage:
        parts.append(f"usage={record.usage}")
    if record.arguments:
        parts.append(f"args={record.arguments}")
    if record.detail:
        parts.append(f"detail={json.dumps(record.detail, ensure_ascii=False)}")
    return "  ".join(parts)


def _show(records: list[AuditRecord], as_json: bool) -> None:
    for record in records:
        if as_json:
            click.echo(json.dumps(record.as_dict(), ensure_ascii=False))
        else:
            click.echo(format_record(record))


@click.group()
def audit() -> None:
    """Read and verify the audit trail."""


@audit.command()
@_store_options
@_key_options
@click.option("--anchor", "anchor_values", multiple=True, metavar="HASH:COUNT|FILE",
              help="The trail must still pass through this anchor (as `stargrpc audit "
              "anchor` printed it), or through every anchor of this file; repeatable.")
@click.option("--require-key", is_flag=True,
              help="Fail on unkeyed records too (a trail that had a key from its start).")
def verify(store_url: str | None, config_file: Path | None, key_files: tuple[Path, ...],
           anchor_values: tuple[str, ...], require_key: bool) -> None:
    """Check the hash chain (and anchors); exit 1 naming the first changed, missing or moved
    record."""
    anchors = _anchors(anchor_values)
    keys = _keys(key_files, config_file, store_url)

    async def work(store: AuditStore) -> None:
        report = await verify_chain(store.scan(), keys, anchors, require_key=require_key)
        if not report.intact:
            click.echo(_broken(report))
            sys.exit(EXIT_BROKEN)
        click.echo(f"ok: {report.checked} records, chain intact, head {report.head_hash}"
                   f"{_summary(report, keys)}")

    _run(store_url, config_file, work)


@audit.command()
@_store_options
@_key_options
def anchor(store_url: str | None, config_file: Path | None,
           key_files: tuple[Path, ...]) -> None:
    """Print the chain's head as HASH:COUNT, once it verifies: keep it outside the store
    (append it to a file elsewhere) and give it to `verify --anchor` later."""
    keys = _keys(key_files, config_file, store_url)

    async def work(store: AuditStore) -> None:
        report = await verify_chain(store.scan(), keys)
        if not report.intact:
            click.echo(_broken(report), err=True)
            sys.exit(EXIT_BROKEN)
        click.echo(str(Anchor(report.head_hash, report.checked)))

    _run(store_url, config_file, work)


def _broken(report: VerifyReport) -> str:
    if report.bad_seq is None:
        return f"BROKEN: {report.reason}"
    return (f"BROKEN at record seq {report.bad_seq} (id {report.bad_id}): "
            f"{report.reason}; the {report.checked} records before it are intact")


def _summary(report: VerifyReport, keys: list[ChainKey]) -> str:
    parts = []
    if report.keyed:
        parts.append(f"{report.keyed} keyed")
    if report.unkeyed:
        parts.append(f"{report.unkeyed} unkeyed (seq 1-{report.unkeyed}, written before "
                     "the trail had a key: their hashes do not prove they were not "
                     "rewritten; an anchor does)")
    if report.anchors:
        parts.append(f"{report.anchors} anchor{'s' if report.anchors > 1 else ''} met")
    if not keys and not report.keyed and report.checked:
        parts.append("no audit key given")
    return f" ({'; '.join(parts)})" if parts else ""


@audit.command()
@_store_options
@click.option("-n", "--lines", "count", type=click.IntRange(min=1), default=20,
              show_default=True, help="How many of the newest records.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new records (Ctrl-C ends).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between polls with --follow.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def tail(store_url: str | None, config_file: Path | None, count: int, follow: bool,
         interval: float, as_json: bool) -> None:
    """Print the newest records, oldest first."""

    async def work(store: AuditStore) -> None:
        records = list(reversed(await store.query(Query(limit=count, newest_first=True))))
        _show(records, as_json)
        last = records[-1].seq if records else 0
        while follow:
            await asyncio.sleep(interval)
            records = await store.query(Query(after_seq=last, limit=1000))
            _show(records, as_json)
            if records:
                last = records[-1].seq

    _run(store_url, config_file, work)


@audit.command()
@_store_options
@click.option("--tool", default=None, help="Only calls of this tool.")
@click.option("--principal", default=None, help="Only calls by this principal, or made on "
              "behalf of this end user.")
@click.option("--outcome", type=click.Choice(OUTCOMES), default=None, help="Only this outcome.")
@click.option("--method", default=None, help="Only calls of this gRPC method (full name or "
              "last part, e.g. Execute).")
@click.option("--since", default=None, help="Only records since an ISO 8601 time or an age "
              "(15m, 2h, 7d).")
@click.option("--root", "root_run_id", default=None, metavar="RUN_ID",
              help="Only the records of one call tree: its root run's and those of every "
              "run below it (refused children too).")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              help="At most this many records (the newest).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def query(store_url: str | None, config_file: Path | None, tool: str | None,
          principal: str | None, outcome: str | None, method: str | None, since: str | None,
          root_run_id: str | None, limit: int, as_json: bool) -> None:
    """Print the records that match, oldest first."""
    since_time = parse_since(since) if since else None

    async def work(store: AuditStore) -> None:
        records = await store.query(Query(tool=tool, principal=principal, outcome=outcome,
                                          method=method, since=since_time,
                                          root_run_id=root_run_id, limit=limit,
                                          newest_first=True))
        _show(list(reversed(records)), as_json)

    _run(store_url, config_file, work)
