"""The HTTP gateway: the ToolService over JSON and Server-Sent Events, and the live progress
page, for browsers and for anything that speaks HTTP rather than gRPC.

The gateway is a client of the same server (:mod:`stargrpc.gateway.client`), so a call
through it is authenticated, authorized, audited and supervised exactly like a gRPC call.
"""

from __future__ import annotations

from stargrpc.gateway.app import Gateway

__all__ = ["Gateway"]
