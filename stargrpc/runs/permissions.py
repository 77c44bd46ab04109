"""Who may run which tool, who may act for someone else, and who may see and act on a run.

The runtime asks the server's :class:`ToolPolicy` on every Execute, before the tool runs
(:meth:`ToolPolicy.delegate`, then :meth:`ToolPolicy.check`); ListTools asks
:meth:`ToolPolicy.can_run` to leave out the tools a caller may not run.

:class:`RolePolicy` is the configured policy. For a tool it takes the allow lists of the
tool's ``tool_permissions`` entry (roles and principal ids, ``"*"`` for any authenticated
caller); a tool without an entry keeps the roles it declares itself when
``permission_default`` is "allow" (by default ``"*"``), and admits admins only when it is
"deny". Holders of ``admin_role`` pass every allow list. A privileged tool (declared so,
or marked in its entry) also needs ``privileged_role``, held explicitly: no wildcard and no
admin role grants it.

:class:`RunAccess` decides who may see, watch, cancel and steer a run that exists: its
owner, holders of ``admin_role``, and the roles each action names. A caller who may not see
a run is told it does not exist, so run ids of other principals cannot be probed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from stargrpc import metrics
from stargrpc.errors import PermissionDenied
from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec
from stargrpc.settings import Settings, ToolAccess

#: Fields of the invocation context that speak for someone other than the caller.
IDENTITY_FIELDS = ("end_user", "channel", "session_id")


class ToolPolicy(Protocol):
    """Decides whether a principal may run a tool."""

    def can_run(self, principal: Principal, spec: ToolSpec) -> bool:
        """Whether ``principal`` may run ``spec``."""
        ...

    def check(self, principal: Principal, spec: ToolSpec) -> None:
        """Returns when ``principal`` may run ``spec``.

        Raises:
            PermissionDenied: With ErrorInfo naming the tool and why.
        """
        ...

    def access(self, spec: ToolSpec) -> ToolAccess:
        """Who may run ``spec`` as configured (what ListTools shows in ``Tool.permissions``);
        holders of the admin role, where there is one, pass as well."""
        ...

    def delegate(self, principal: Principal, invocation: Mapping[str, Any]) -> Principal:
        """The principal a call runs as, given the identity fields of its invocation context.

        Returns:
            ``principal``, with ``acting_for`` set when it names an end user and may.

        Raises:
            PermissionDenied: The request names an end user (or channel, session) and the
                caller may not act for others.
        """
        ...


def _named(invocation: Mapping[str, Any]) -> list[str]:
    return [name for name in IDENTITY_FIELDS if invocation.get(name)]


def _acting_for(principal: Principal, invocation: Mapping[str, Any]) -> Principal:
    end_user = str(invocation.get("end_user") or "")
    return dataclasses.replace(principal, acting_for=end_user) if end_user else principal


class AllowAll:
    """Every caller may run every tool and act for anyone: for tests of a runtime without
    authentication. A server always builds a :class:`RolePolicy` (with authentication off
    its caller holds every role, which has the same effect)."""

    def can_run(self, principal: Principal, spec: ToolSpec) -> bool:
        return True

    def check(self, principal: Principal, spec: ToolSpec) -> None:
        return None

    def access(self, spec: ToolSpec) -> ToolAccess:
        return ToolAccess(roles=["*"], privileged=spec.privileged)

    def delegate(self, principal: Principal, invocation: Mapping[str, Any]) -> Principal:
        return _acting_for(principal, invocation)


class RolePolicy:
    """Per-tool allow lists by role and principal; see the module docstring."""

    def __init__(self, *, rules: Mapping[str, ToolAccess] | None = None,
                 default: str = "allow", admin_role: str = "admin",
                 privileged_role: str = "privileged", delegation_role: str = "delegate"
                 ) -> None:
        self._rules = dict(rules or {})
        # Who may run a tool depends only on the tool's declaration and the rules: worked out
        # once per declaration rather than on every call.
        self._access: dict[tuple[str, bool, tuple[str, ...]], ToolAccess] = {}
        self._default = default
        self._admin_role = admin_role
        self._privileged_role = privileged_role
        self._delegation_role = delegation_role

    @classmethod
    def from_settings(cls, settings: Settings) -> RolePolicy:
        """The policy ``settings`` configure."""
        return cls(rules=settings.tool_permissions, default=settings.permission_default,
                   admin_role=settings.admin_role, privileged_role=settings.privileged_role,
                   delegation_role=settings.delegation_role)

    def refusal(self, principal: Principal, spec: ToolSpec) -> PermissionDenied | None:
        """Why ``principal`` may not run ``spec``, or None when it may."""
        access = self.access(spec)
        allowed = principal.has_role(self._admin_role) or (
            "*" in access.roles or "*" in access.principals or principal.id in access.principals
            or any(principal.has_role(role) for role in access.roles))
        if allowed and (not access.privileged or principal.has_role(self._privileged_role)):
            return None
        metadata = {"tool_name": spec.name, "principal": principal.id}
        if not allowed:
            return PermissionDenied(f"{principal.id!r} may not run tool {spec.name!r}",
                                    reason="TOOL_NOT_ALLOWED", metadata=metadata)
        if access.privileged and not principal.has_role(self._privileged_role):
            return PermissionDenied(
                f"tool {spec.name!r} is privileged: it needs the role "
                f"{self._privileged_role!r}",
                reason="PRIVILEGED_ROLE_REQUIRED",
                metadata={**metadata, "required_role": self._privileged_role})
        return None

    def access(self, spec: ToolSpec) -> ToolAccess:
        key = (spec.name, spec.privileged, (*spec.allowed_roles, "", *spec.allowed_principals))
        access = self._access.get(key)
        if access is None:
            access = self._access[key] = self._work_out_access(spec)
        return access

    def _work_out_access(self, spec: ToolSpec) -> ToolAccess:
        rule = self._rules.get(spec.name)
        privileged = spec.privileged or (rule is not None and rule.privileged)
        if rule is not None:
            return ToolAccess(roles=rule.roles, principals=rule.principals,
                              privileged=privileged)
        if self._default == "allow":
            return ToolAccess(roles=list(spec.allowed_roles),
                              principals=list(spec.allowed_principals), privileged=privileged)
        return ToolAccess(roles=[self._admin_role], privileged=privileged)

    def can_run(self, principal: Principal, spec: ToolSpec) -> bool:
        return self.refusal(principal, spec) is None

    def check(self, principal: Principal, spec: ToolSpec) -> None:
        refusal = self.refusal(principal, spec)
        if refusal is not None:
            metrics.AUTH_FAILURES.labels(refusal.reason.lower()).inc()
            raise refusal

    def delegate(self, principal: Principal, invocation: Mapping[str, Any]) -> Principal:
        named = _named(invocation)
        if named and not principal.has_role(self._delegation_role):
            metrics.AUTH_FAILURES.labels("delegation_not_allowed").inc()
            raise PermissionDenied(
                f"{', '.join(named)} in the invocation context may only be given by a caller "
                f"with the role {self._delegation_role!r}",
                reason="DELEGATION_NOT_ALLOWED",
                metadata={"fields": ",".join(f"context.{name}" for name in named),
                          "principal": principal.id, "required_role": self._delegation_role})
        return _acting_for(principal, invocation)


@dataclasses.dataclass(frozen=True)
class RunAccess:
    """Who may see and act on runs they do not own.

    The owner of a run and holders of ``admin_role`` may do everything to it. Beyond them:

    Attributes:
        admin_role: Holders see every run and may act on each.
        watch_roles: Holders may watch (and list) anyone's runs, but not act on them.
        steer_roles: Holders may steer anyone's run (``delegation_role`` and
            ``run_steer_roles``); seeing it is part of steering it.
    """

    admin_role: str
    watch_roles: tuple[str, ...]
    steer_roles: tuple[str, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> RunAccess:
        """The access the settings configure (``admin_role``, ``run_watch_roles``,
        ``delegation_role`` and ``run_steer_roles``)."""
        return cls(admin_role=settings.admin_role,
                   watch_roles=tuple(settings.run_watch_roles),
                   steer_roles=(settings.delegation_role, *settings.run_steer_roles))

    def _owns_or_holds(self, principal: Principal, owner: str, roles: tuple[str, ...]) -> bool:
        return (owner == principal.id or principal.has_role(self.admin_role)
                or any(principal.has_role(role) for role in roles))

    def sees_all_runs(self, principal: Principal) -> bool:
        """Whether ``principal`` lists every principal's runs (and sees who owns each)."""
        return principal.has_role(self.admin_role) or any(
            principal.has_role(role) for role in self.watch_roles)

    def may_watch(self, principal: Principal, owner: str) -> bool:
        """Whether ``principal`` may read the events of a run of ``owner``."""
        return self._owns_or_holds(principal, owner, self.watch_roles)

    def may_cancel(self, principal: Principal, owner: str) -> bool:
        """Whether ``principal`` may cancel a run of ``owner``."""
        return self._owns_or_holds(principal, owner, ())

    def may_hang_under(self, principal: Principal, owner: str) -> bool:
        """Whether ``principal`` may start a run under a run of ``owner`` (its child, in its
        tree: it would share the tree's state and spend the tree's budget) — acting on
        the run, which a watcher may not."""
        return self._owns_or_holds(principal, owner, ())

    def may_see_to_steer(self, principal: Principal, owner: str) -> bool:
        """Whether a steer of ``principal`` finds a run of ``owner`` (rather than NOT_FOUND):
        a watcher finds it and is then refused, which tells it nothing it could not read."""
        return self._owns_or_holds(principal, owner, (*self.steer_roles, *self.watch_roles))

    def may_steer(self, principal: Principal, owner: str) -> bool:
        """Whether ``principal`` may steer a run of ``owner``."""
        return self._owns_or_holds(principal, owner, self.steer_roles)
