"""Delivery of a run's Result to a target named in the request (webhook, Redis stream).

- :mod:`stargrpc.delivery.target`: the target of a request, checked before its run starts.
- :mod:`stargrpc.delivery.signing`: the ``stargrpc-signature`` header, made and verified.
- :mod:`stargrpc.delivery.deliveries`: sends each Result, at least once, with retries, and
  (in a fleet) keeps the pending deliveries in Redis so another replica finishes them.
"""

from __future__ import annotations

from stargrpc.delivery.deliveries import Deliveries
from stargrpc.delivery.signing import SIGNATURE_HEADER, sign, verify
from stargrpc.delivery.target import DeliveryTarget

__all__ = ["SIGNATURE_HEADER", "Deliveries", "DeliveryTarget", "sign", "verify"]
