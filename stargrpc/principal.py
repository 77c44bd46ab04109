"""Who is calling: the authenticated principal, carried in a context variable.

The authentication interceptor sets :data:`current_principal` for the duration of a call;
the service and tools read it (tools through ``ToolContext.principal``). Identity never
comes from a request body.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Principal:
    """An authenticated caller.

    Attributes:
        id: Stable identifier (API key name, JWT subject, certificate subject).
        roles: Roles and scopes granted to the caller.
        method: How the caller authenticated: "api_key", "jwt", "mtls" or "none".
        acting_for: The end user a delegating caller acts for, when honoured.
    """

    id: str
    roles: frozenset[str] = field(default_factory=frozenset)
    method: str = "none"
    acting_for: str = ""

    def has_role(self, role: str) -> bool:
        """Whether the principal holds ``role``."""
        return role in self.roles

    def describe(self) -> str:
        """"alice" or "alice acting for bob", as audit records show it."""
        return f"{self.id} acting for {self.acting_for}" if self.acting_for else self.id


#: Longest principal id credentials may name (a JWT's subject, a certificate's subject): as
#: long as an ``end_user`` may be. A longer one is refused, not cut: two identities that
#: differ only past a cut would become one caller.
MAX_PRINCIPAL_CHARS = 256

#: The caller when no authentication is configured (local experiments only).
ANONYMOUS = Principal(id="anonymous", roles=frozenset(), method="none")

#: The principal of the call being served; set by the authentication interceptor.
current_principal: ContextVar[Principal] = ContextVar("stargrpc_principal", default=ANONYMOUS)
