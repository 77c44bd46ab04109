"""The delivery target of a request, checked before its run starts: a webhook must name an
``https`` URL whose host is on ``delivery_allowlist`` and resolves only to addresses the
SSRF rules of ``http_fetch`` accept (:mod:`stargrpc.egress`); a Redis stream needs a
fleet (``redis_url``) and a plain name."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Literal

from stargrpc.egress import HttpPolicy, Refused, vet_url
from stargrpc.errors import FailedPrecondition, FieldViolation, InvalidArgument, PermissionDenied
from stargrpc.errors import reason_name as _reason_name
from stargrpc.settings import Settings
from stargrpc.stores.keys import RESERVED_KEY_NAMES, is_reserved_key
from stargrpc.v1 import errors_pb2, tool_service_pb2

_NOT_ALLOWED = _reason_name(errors_pb2.DELIVERY_NOT_ALLOWED)
_UNAVAILABLE = _reason_name(errors_pb2.DELIVERY_UNAVAILABLE)
_STREAM_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
_MAX_URL_CHARS = 2048


@dataclass(frozen=True)
class DeliveryTarget:
    """Where a run's Result goes.

    Attributes:
        kind: "webhook" or "redis_stream".
        address: The webhook's URL, or the stream's name (after the key prefix).
    """

    kind: Literal["webhook", "redis_stream"]
    address: str

    def to_json(self) -> str:
        """The target as JSON, as a pending delivery keeps it."""
        return json.dumps({"kind": self.kind, "address": self.address})

    @classmethod
    def from_json(cls, text: str | bytes) -> DeliveryTarget:
        """The target :meth:`to_json` wrote."""
        data = json.loads(text)
        if data["kind"] not in ("webhook", "redis_stream"):
            raise ValueError(f"unknown delivery kind {data['kind']!r}")
        return cls(data["kind"], str(data["address"]))


def delivery_policy(settings: Settings) -> HttpPolicy:
    """The SSRF rules of webhook deliveries: http_fetch's, with the delivery allowlist."""
    return HttpPolicy(tuple(settings.delivery_allowlist),
                      tuple(ipaddress.ip_network(n, strict=False)
                            for n in settings.delivery_allowed_networks))


async def checked_target(delivery: tool_service_pb2.Delivery, settings: Settings, *,
                         fleet: bool) -> DeliveryTarget | None:
    """The target a request names (None for none), checked.

    Raises:
        InvalidArgument: The target is malformed (BadRequest names the field).
        PermissionDenied: A webhook host off the allowlist or resolving to a refused
            address (reason DELIVERY_NOT_ALLOWED).
        FailedPrecondition: This server cannot deliver there (reason DELIVERY_UNAVAILABLE).
    """
    which = delivery.WhichOneof("target")
    if which == "redis_stream":
        stream = delivery.redis_stream.stream
        if not _STREAM_NAME.fullmatch(stream):
            raise InvalidArgument("the delivery stream name is not valid", [FieldViolation(
                "delivery.redis_stream.stream", "1 to 200 characters of [A-Za-z0-9_.:-]")])
        if is_reserved_key(stream):
            # The stream is XADDed under the key prefix, beside the store's own keys: a name
            # of theirs would write into another principal's run log, a lane's queue, the
            # page token key (every ListRuns of the fleet would fail).
            raise InvalidArgument("the delivery stream name is one of the run store's keys",
                                  [FieldViolation("delivery.redis_stream.stream",
                                                  "a name not starting with one of the run "
                                                  "store's keys: " + ", ".join(
                                                      RESERVED_KEY_NAMES))])
        if not fleet:
            raise FailedPrecondition("Redis stream delivery needs a fleet (redis_url)",
                                     reason=_UNAVAILABLE)
        return DeliveryTarget("redis_stream", stream)
    if which != "webhook":
        return None
    url = delivery.webhook.url
    field = "delivery.webhook.url"
    if not url.startswith("https://") or len(url) > _MAX_URL_CHARS:
        raise InvalidArgument("the webhook URL must be https", [FieldViolation(
            field, f"an https:// URL of at most {_MAX_URL_CHARS} characters")])
    if settings.delivery_webhook_secret_file is None:
        raise FailedPrecondition("webhook delivery needs delivery_webhook_secret_file",
                                 reason=_UNAVAILABLE)
    try:
        await vet_url(url, delivery_policy(settings))
    except Refused as exc:
        if exc.code == "BAD_URL":
            raise InvalidArgument("the webhook URL is not valid",
                                  [FieldViolation(field, str(exc))]) from exc
        raise PermissionDenied(str(exc).replace("http_fetch allowlist", "delivery_allowlist"),
                               reason=_NOT_ALLOWED, metadata={"refusal": exc.code}) from exc
    return DeliveryTarget("webhook", url)
