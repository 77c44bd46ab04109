"""Who may run which tool and act for whom: the policy on its own, then through a server."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from stargrpc.errors import PermissionDenied
from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec
from stargrpc.runs.permissions import AllowAll, RolePolicy, RunAccess
from stargrpc.settings import Settings, ToolAccess
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.helpers import key_channel, run_tool, status_details

TOOLS = auth_registry()
WHOAMI, DANGER, OPS_ONLY = TOOLS["whoami"], TOOLS["danger"], TOOLS["ops_only"]


def who(*roles: str, name: str = "alice") -> Principal:
    return Principal(id=name, roles=frozenset(roles), method="api_key")


def reason(policy: RolePolicy, principal: Principal, spec: ToolSpec) -> str:
    refusal = policy.refusal(principal, spec)
    return "allowed" if refusal is None else refusal.reason


@pytest.mark.parametrize(("principal", "spec", "expected"), [
    (who(), WHOAMI, "allowed"),                                   # declares "*"
    (who(), OPS_ONLY, "TOOL_NOT_ALLOWED"),                        # declares ("ops",)
    (who("ops"), OPS_ONLY, "allowed"),
    (who("admin"), OPS_ONLY, "allowed"),                          # admins pass allow lists
    (who("admin"), DANGER, "PRIVILEGED_ROLE_REQUIRED"),           # ... but not privilege
    (who("privileged"), DANGER, "allowed"),
    (who("ops", "privileged"), DANGER, "allowed"),
])
def test_declared_roles_admin_and_privilege(principal, spec, expected) -> None:
    assert reason(RolePolicy(), principal, spec) == expected


def test_configured_entries_override_what_a_tool_declares() -> None:
    policy = RolePolicy(rules={
        "whoami": ToolAccess(principals=["bob"]),
        "ops_only": ToolAccess(roles=["*"]),
        "danger": ToolAccess(roles=["ops"]),
    })

    assert reason(policy, who(), WHOAMI) == "TOOL_NOT_ALLOWED"
    assert reason(policy, who(name="bob"), WHOAMI) == "allowed"
    assert reason(policy, who(), OPS_ONLY) == "allowed"
    assert reason(policy, who("privileged"), DANGER) == "TOOL_NOT_ALLOWED"
    assert reason(policy, who("ops"), DANGER) == "PRIVILEGED_ROLE_REQUIRED"
    assert reason(policy, who("ops", "privileged"), DANGER) == "allowed"


def test_a_wildcard_entry_never_grants_privilege() -> None:
    policy = RolePolicy(rules={"whoami": ToolAccess(roles=["*"], principals=["*"],
                                                    privileged=True)})

    assert reason(policy, who("admin"), WHOAMI) == "PRIVILEGED_ROLE_REQUIRED"
    assert reason(policy, who("privileged"), WHOAMI) == "allowed"


def test_default_deny_admits_only_admins_to_tools_without_an_entry() -> None:
    policy = RolePolicy(default="deny", rules={"ops_only": ToolAccess(roles=["ops"])})

    assert reason(policy, who("reader"), WHOAMI) == "TOOL_NOT_ALLOWED"
    assert reason(policy, who("admin"), WHOAMI) == "allowed"
    assert reason(policy, who("ops"), OPS_ONLY) == "allowed"


def test_identity_fields_need_the_delegation_role() -> None:
    policy = RolePolicy()

    with pytest.raises(PermissionDenied) as caught:
        policy.delegate(who("admin"), {"end_user": "bob", "channel": "web"})
    assert caught.value.reason == "DELEGATION_NOT_ALLOWED"
    assert caught.value.metadata["fields"] == "context.end_user,context.channel"
    for fields in ({"channel": "slack"}, {"session_id": "s1"}):
        with pytest.raises(PermissionDenied):
            policy.delegate(who(), fields)
    # Not identity: a trace id and labels are fine from anyone.
    assert policy.delegate(who(), {"trace_id": "t", "labels": {"a": "b"}}) == who()
    assert policy.delegate(who("delegate"), {"end_user": "bob"}).describe() == \
        "alice acting for bob"
    assert AllowAll().delegate(who(), {"end_user": "bob"}).acting_for == "bob"


# -- through a server ------------------------------------------------------------------------


async def execute_error(target: str, key: str, tool_name: str,
                        **fields: object) -> grpc.aio.AioRpcError:
    async with key_channel(target, key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_tool(stub, tool_name, {}, **fields)
    return caught.value


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    infos = [d for d in status_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert len(infos) == 1
    return infos[0]


async def test_a_refused_tool_is_permission_denied_with_error_info(make_auth_server) -> None:
    auth = await make_auth_server(TOOLS, roles=["admin"])

    denied = await execute_error(auth.target, auth.key, "danger")

    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(denied)
    assert info.reason == "PRIVILEGED_ROLE_REQUIRED"
    assert info.domain == "stargrpc"
    assert dict(info.metadata) == {"tool_name": "danger", "principal": "tester",
                                   "required_role": "privileged"}


async def test_configured_permissions_apply_on_every_call(make_auth_server) -> None:
    auth = await make_auth_server(
        TOOLS, roles=["reader"],
        tool_permissions={"whoami": {"principals": ["ci-bot"]}, "ops_only": {"roles": ["*"]}})
    bot = auth.add_key("ci-bot")

    denied = await execute_error(auth.target, auth.key, "whoami")
    async with key_channel(auth.target, bot) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        bot_events = await run_tool(stub, "whoami", {})
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        ops_events = await run_tool(stub, "ops_only", {})

    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(denied).reason == "TOOL_NOT_ALLOWED"
    assert bot_events[-1].result.output == "ci-bot api_key "
    assert ops_events[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_an_end_user_in_the_request_needs_the_delegation_role(make_auth_server) -> None:
    auth = await make_auth_server(TOOLS, roles=["admin"])
    gateway = auth.add_key("gateway", "delegate")
    for_bob = tool_service_pb2.InvocationContext(end_user="bob", channel="web")

    denied = await execute_error(auth.target, auth.key, "whoami", context=for_bob)
    async with key_channel(auth.target, gateway) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {},
                                context=for_bob)

    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(denied).reason == "DELEGATION_NOT_ALLOWED"
    assert events[-1].result.output == "gateway acting for bob api_key delegate"


async def list_tools(target: str, key: str) -> dict[str, bool]:
    async with key_channel(target, key) as channel:
        reply = await tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
            tool_service_pb2.ListToolsRequest())
    return {tool.name: tool.permissions.callable for tool in reply.tools}


async def test_list_tools_shows_a_caller_only_what_it_may_run(make_auth_server) -> None:
    auth = await make_auth_server(TOOLS, roles=["reader"])
    ops = auth.add_key("operator", "ops", "privileged")

    assert await list_tools(auth.target, auth.key) == {"whoami": True}
    assert await list_tools(auth.target, ops) == {"whoami": True, "danger": True,
                                                  "ops_only": True}


async def test_list_tools_can_mark_instead_of_hide(make_auth_server) -> None:
    auth = await make_auth_server(TOOLS, roles=["reader"], list_tools_show_uncallable=True)

    assert await list_tools(auth.target, auth.key) == {"whoami": True, "danger": False,
                                                       "ops_only": False}


async def test_list_tools_shows_who_may_run_each_tool_as_configured(make_auth_server) -> None:
    auth = await make_auth_server(
        TOOLS, roles=["admin", "privileged"], permission_default="deny",
        tool_permissions={"ops_only": {"roles": ["ops"], "principals": ["ci-bot"],
                                       "privileged": True}})

    async with key_channel(auth.target, auth.key) as channel:
        reply = await tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
            tool_service_pb2.ListToolsRequest())
    shown = {t.name: (list(t.permissions.allowed_roles), list(t.permissions.allowed_principals),
                      t.permissions.privileged) for t in reply.tools}

    assert shown == {"whoami": (["admin"], [], False),  # no entry, default deny: admins only
                     "danger": (["admin"], [], True),
                     "ops_only": (["ops"], ["ci-bot"], True)}


def test_run_access_follows_the_settings_roles() -> None:
    access = RunAccess.from_settings(Settings(admin_role="boss", run_watch_roles=["ops"],
                                              delegation_role="agent",
                                              run_steer_roles=["critic"]))
    owner, stranger = Principal(id="alice"), Principal(id="bob")
    boss, ops = Principal(id="c", roles=("boss",)), Principal(id="d", roles=("ops",))
    critic, agent = Principal(id="e", roles=("critic",)), Principal(id="f", roles=("agent",))

    # The owner and the admin role may do everything; a stranger nothing.
    for who in (owner, boss):
        assert access.may_watch(who, "alice") and access.may_cancel(who, "alice")
        assert access.may_see_to_steer(who, "alice") and access.may_steer(who, "alice")
    assert not any(rule(stranger, "alice") for rule in (
        access.may_watch, access.may_cancel, access.may_see_to_steer, access.may_steer))
    # A watcher watches and finds a run to steer, but may neither steer nor cancel it.
    assert access.may_watch(ops, "alice") and access.may_see_to_steer(ops, "alice")
    assert not access.may_steer(ops, "alice") and not access.may_cancel(ops, "alice")
    # Steerers (the critic role and the delegation role) steer, but neither watch nor cancel.
    for who in (critic, agent):
        assert access.may_steer(who, "alice") and access.may_see_to_steer(who, "alice")
        assert not access.may_watch(who, "alice") and not access.may_cancel(who, "alice")
    # Only the admin and watch roles list every principal's runs.
    assert access.sees_all_runs(boss) and access.sees_all_runs(ops)
    assert not any(access.sees_all_runs(p) for p in (owner, critic, agent))
