"""A record's hash covers the same canonical JSON however it is written: the chain module
writes it field by field, and that text must be json's own with sorted keys."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import random

from stargrpc.audit.chain import record_hash
from stargrpc.audit.key import ChainKey
from stargrpc.audit.record import AuditRecord

_TEXTS = ["", "a", "Ω ü 日本", '"quoted" \\ back', "line\nbreak\ttab\x00\x1f", "😀 emoji",
          "\u2028\u2029", "</script>", " ", "0"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXTS) for _ in range(rng.randint(0, 3)))


def _random_record(rng: random.Random) -> AuditRecord:
    values: dict[str, object] = {}
    for field in dataclasses.fields(AuditRecord):
        if field.name == "duration_ms":
            values[field.name] = rng.choice([0.0, 1.5, 1e-7, 12345678.125, 1e22, -0.0,
                                             rng.random() * 1000])
        elif field.name == "privileged":
            values[field.name] = rng.random() < 0.5
        elif field.name == "seq":
            values[field.name] = rng.randint(0, 2**63)
        else:
            values[field.name] = _text(rng)
    return AuditRecord(**values)  # type: ignore[arg-type]


def _reference_hash(record: AuditRecord, key: ChainKey | None) -> str:
    fields = {name: value for name, value in dataclasses.asdict(record).items()
              if name != "hash" and value != ""}
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False,
                           separators=(",", ":")).encode("utf-8")
    if key is None:
        return hashlib.sha256(canonical).hexdigest()
    return hmac.new(key.secret, canonical, hashlib.sha256).hexdigest()


def test_the_hash_covers_json_s_own_canonical_text() -> None:
    rng = random.Random(15)
    keys = [None, ChainKey.from_secret(b"k" * 32), ChainKey.from_secret(b"other" * 8)]
    for _ in range(3000):
        record = _random_record(rng)
        key = rng.choice(keys)
        assert record_hash(record, key) == _reference_hash(record, key), record



def test_the_interceptor_s_record_has_every_field_and_no_other(tmp_path: object) -> None:
    from pathlib import Path

    from stargrpc.audit.record import FIELDS
    from stargrpc.runs.call_record import CallRecord
    from stargrpc.server.interceptors.audit import AuditInterceptor, _AuditedCall
    from stargrpc.settings import Settings

    assert isinstance(tmp_path, Path)
    interceptor = AuditInterceptor(Settings.load(state_dir=tmp_path))
    made = interceptor._audit_record(_AuditedCall(CallRecord(method="/m")))
    assert tuple(vars(made)) == FIELDS
    assert made == AuditRecord(**vars(made))  # type: ignore[arg-type]
