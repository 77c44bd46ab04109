"""``stargrpc state get/set/delete/list``: run state (what tools keep through ``ctx.state``)
for operators, through RunStateService: the admin role only, and every call audited."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click

from stargrpc.cli.client_commands import _fail, connection_options, terminal_safe
from stargrpc.client import Client, ClientError

_SCOPES = ["run", "tree", "principal", "global"]

T = TypeVar("T")


def _ask(client_options: dict[str, Any], call: Callable[[Client], T]) -> T:
    """``call`` with a client of the server; a refusal ends the command (exit 1)."""
    with Client(**client_options) as client:
        try:
            return call(client)
        except ClientError as exc:
            _fail(exc)


def _scope_options(command: Any) -> Any:
    """``--scope``, ``--run`` and ``--principal``, checked together."""
    command = click.option("--principal", default="",
                           help="The principal's id (scope principal).")(command)
    command = click.option("--run", "run_id", default="",
                           help="The run (scope run), or the tree's root run (scope tree).")(
        command)
    return click.option("--scope", type=click.Choice(_SCOPES), required=True,
                        help="Which state: a run's, a tree's, a principal's, or global.")(
        command)


def _where(scope: str, run_id: str, principal: str) -> dict[str, str]:
    if scope in ("run", "tree") and not run_id:
        raise click.UsageError(f"--scope {scope} needs --run RUN_ID")
    if scope == "principal" and not principal:
        raise click.UsageError("--scope principal needs --principal ID")
    return {"run_id": run_id, "principal": principal}


@click.group()
def state() -> None:
    """Read and change run state (admin role; audited)."""


@state.command("get")
@connection_options
@_scope_options
@click.argument("key")
def get(client_options: dict[str, Any], scope: str, run_id: str, principal: str,
        key: str) -> None:
    """Print the value of KEY as JSON; exit 3 when it is absent."""
    where = _where(scope, run_id, principal)
    missing = object()
    value = _ask(client_options, lambda client: client.get_state(scope, key, missing,
                                                                  timeout=30, **where))
    if value is missing:
        click.echo(f"{key}: absent", err=True)
        raise SystemExit(3)
    click.echo(json.dumps(value, ensure_ascii=False))


@state.command("set")
@connection_options
@_scope_options
@click.argument("key")
@click.argument("value")
@click.option("--ttl", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds the entry lives (default: as long as the scope).")
def set_(client_options: dict[str, Any], scope: str, run_id: str, principal: str, key: str,
         value: str, ttl: float | None) -> None:
    """Set KEY to VALUE, a JSON text (a string is quoted: '"text"')."""
    where = _where(scope, run_id, principal)
    try:
        parsed = json.loads(value, parse_constant=_no_constant)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc}); quote a string as '\"text\"'",
                                 param_hint="VALUE") from None
    except RecursionError:
        raise click.BadParameter("not JSON: nested too deeply", param_hint="VALUE") from None
    _ask(client_options, lambda client: client.set_state(scope, key, parsed, ttl=ttl,
                                                          timeout=30, **where))


@state.command("delete")
@connection_options
@_scope_options
@click.argument("key")
def delete(client_options: dict[str, Any], scope: str, run_id: str, principal: str,
           key: str) -> None:
    """Remove KEY; exit 3 when it was absent."""
    where = _where(scope, run_id, principal)
    deleted = _ask(client_options, lambda client: client.delete_state(scope, key, timeout=30,
                                                                       **where))
    if not deleted:
        click.echo(f"{key}: absent", err=True)
        raise SystemExit(3)


@state.command("list")
@connection_options
@_scope_options
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--values", "with_values", is_flag=True, help="Print each value too.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="Keys per page.")
@click.option("--after", "after_key", default="", help="Go on after this key (a previous "
              "page's last).")
def list_(client_options: dict[str, Any], scope: str, run_id: str, principal: str,
          prefix: str, with_values: bool, limit: int, after_key: str) -> None:
    """List the keys of a scope, sorted (with --values, KEY<TAB>JSON). Where the next page
    starts goes to stderr."""
    where = _where(scope, run_id, principal)
    page = _ask(client_options, lambda client: client.list_state(
        scope, prefix=prefix, page_size=limit, after_key=after_key, with_values=with_values,
        timeout=30, **where))
    for entry in page.entries:
        click.echo(terminal_safe(f"{entry.key}\t{entry.value_json}" if with_values
                                  else entry.key))
    if page.next_after_key:
        click.echo(f"more: --after {page.next_after_key}", err=True)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
