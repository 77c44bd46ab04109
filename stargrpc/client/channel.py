"""Opening channels and building the credentials metadata."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from stargrpc import __version__

#: Seconds between the HTTP/2 pings a channel sends while a call is open, and how long it
#: waits for the answer before it takes the connection for dead. Without them a server that
#: stopped answering (a stopped process, a host gone without closing its connections, a
#: network cut) holds a call with no deadline for ever; with them the call fails UNAVAILABLE
#: and a run's stream is resumed. A stargrpc server accepts pings every 10 s.
KEEPALIVE_TIME_SECONDS = 20
KEEPALIVE_TIMEOUT_SECONDS = 10

#: Channel options every channel the client opens gets, before the caller's own (which win).
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.primary_user_agent", f"stargrpc-python/{__version__}"),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    # gRPC's own wait for a ping's answer (a minute) would otherwise outlast the one above.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    # gRPC stops pinging after two pings with no data between them (its default): a run
    # silent for a minute (a long sleep, a wait for approval) would then lose the watch.
    # The server's floor between pings is 10 s; these come every 20 s at most.
    ("grpc.http2.max_pings_without_data", 0),
)


def bearer_metadata(api_key: str | None = None, token: str | None = None
                    ) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata for an API key or a JWT (both travel as bearer).

    Raises:
        ValueError: Both were given, or it holds characters a header cannot carry (a
            stray carriage return from a file with CRLF line ends, say).
    """
    if api_key and token:
        raise ValueError("give an API key or a token, not both")
    secret = api_key or token
    if secret and not (secret.isascii() and secret.isprintable()):
        # Named before any call: gRPC would refuse the metadata with no word of which.
        raise ValueError("the API key or token holds characters a header cannot carry "
                         "(a line end, a control or non-ASCII character)")
    return (("authorization", f"Bearer {secret}"),) if secret else ()


def channel_credentials(*, ca_file: str | Path | None = None,
                        cert_file: str | Path | None = None,
                        key_file: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS credentials: the system roots or ``ca_file``, and a client certificate for mTLS
    when ``cert_file`` and ``key_file`` are given."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes() if ca_file else None,
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )


def open_channel(target: str, *, tls: bool = False, ca_file: str | Path | None = None,
                 cert_file: str | Path | None = None, key_file: str | Path | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target``: TLS when ``tls`` or any certificate file is given,
    plaintext otherwise. Must be called with the event loop that will use it running."""
    all_options = [*DEFAULT_OPTIONS, *options]
    if tls or ca_file or cert_file:
        credentials = channel_credentials(ca_file=ca_file, cert_file=cert_file,
                                          key_file=key_file)
        return grpc.aio.secure_channel(target, credentials, options=all_options)
    return grpc.aio.insecure_channel(target, options=all_options)
