"""Server interceptors, composed in one chain.

The order is the way of one call: authentication establishes the principal, audit records
the attempt (also when authentication failed), the critic supervises the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from stargrpc.settings import Settings


def build_chain(settings: Settings) -> Sequence[grpc.aio.ServerInterceptor]:
    """The interceptors of a server with ``settings``, outermost first."""
    del settings  # each interceptor reads its own settings as it lands
    return []
