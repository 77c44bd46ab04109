"""A receiver of stargrpc webhook deliveries that verifies their signature.

stargrpc POSTs a run's Result as JSON ``{"run_id": …, "tool_name": …, "result": {…}}`` with
the header ``stargrpc-signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">``,
keyed with the file the server's ``delivery_webhook_secret_file`` names. This receiver
recomputes the HMAC over the exact bytes received, compares in constant time, refuses a
signature older (or newer) than five minutes, and de-duplicates by ``run_id`` (delivery is at
least once). It needs only the standard library::

    python examples/webhook_receiver.py --secret-file delivery.key \\
        --cert server.pem --key server.key --port 8443

Answer 2xx only once the delivery is safely handled: anything else is retried.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

#: Largest body taken.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: How far a signature's time may be from this host's clock.
TOLERANCE_SECONDS = 300


def verify(key: bytes, header: str, body: bytes, *, tolerance: float = TOLERANCE_SECONDS,
           now: float | None = None) -> bool:
    """Whether ``header`` (stargrpc-signature) signs ``body`` with ``key``, recently."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        fields.setdefault(name, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))


class Receiver(ThreadingHTTPServer):
    """Keeps the verified deliveries, once per run id.

    Attributes:
        key: The signing key.
        deliveries: The deliveries taken, by run id.
        fail_first: Answer 503 to this many valid deliveries first (to see retries).
        refused: How many requests were refused (bad signature or body).
        received: Set whenever a delivery is taken.
    """

    def __init__(self, address: tuple[str, int], key: bytes, *, fail_first: int = 0) -> None:
        super().__init__(address, _Handler)
        self.key = key
        self.deliveries: dict[str, dict[str, Any]] = {}
        self.fail_first = fail_first
        self.attempts = 0
        self.refused = 0
        self.received = threading.Event()
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            return self._answer(413)
        body = self.rfile.read(length)
        if not verify(self.server.key, self.headers.get("stargrpc-signature", ""), body):
            with self.server.lock:
                self.server.refused += 1
            return self._answer(401)
        delivery = json.loads(body)
        with self.server.lock:
            self.server.attempts += 1
            if self.server.attempts <= self.server.fail_first:
                return self._answer(503)
            # At least once: a repeated run id is acknowledged and not handled again.
            self.server.deliveries.setdefault(delivery["run_id"], delivery)
        self.server.received.set()
        return self._answer(204)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve(port: int, key: bytes, cert: Path, private_key: Path, *, host: str = "127.0.0.1",
          fail_first: int = 0) -> Receiver:
    """A TLS receiver on ``host:port`` (0 picks a free port); call ``serve_forever()``."""
    receiver = Receiver((host, port), key, fail_first=fail_first)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, private_key)
    receiver.socket = context.wrap_socket(receiver.socket, server_side=True)
    return receiver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--secret-file", type=Path, required=True)
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8443)
    args = parser.parse_args()
    receiver = serve(args.port, args.secret_file.read_bytes().strip(), args.cert, args.key,
                     host=args.host)
    print(f"listening on https://{args.host}:{receiver.server_address[1]}/", flush=True)
    receiver.serve_forever()


if __name__ == "__main__":
    main()
