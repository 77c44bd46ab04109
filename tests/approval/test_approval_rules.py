"""Which runs need approval (the tool's own flag and ``approval_policy``), and the
embedded store's one-time transitions and expiry — no server needed."""

from __future__ import annotations

import asyncio

import pytest

from stargrpc.errors import InvalidArgument
from stargrpc.principal import Principal
from stargrpc.registry import spec_of
from stargrpc.runs.approval import ApprovalRules, check_decision
from stargrpc.settings import Settings
from stargrpc.stores.approvals import (
    APPROVED,
    DECIDED,
    DENIED,
    DIGEST_MISMATCH,
    ID_MISMATCH,
    MISSING,
    NOT_PENDING,
    TIMED_OUT,
    ApprovalRecord,
    MemoryApprovalStore,
    now_ms,
)
from tests.approval.approval_helpers import deploy, greet, wipe

DEPLOY, WIPE, GREET = spec_of(deploy), spec_of(wipe), spec_of(greet)
ALICE = Principal("alice")
INTERN = Principal("ivy", frozenset({"intern"}))
BOT = Principal("bot", frozenset({"automation", "intern"}))


def rules(**policy: object) -> ApprovalRules:
    return ApprovalRules.from_settings(Settings(approval_policy=policy))


@pytest.mark.parametrize(("policy", "principal", "wanted"), [
    ({}, ALICE, {"deploy"}),                                    # the tool's own flag
    ({"destructive": True}, ALICE, {"deploy", "wipe"}),
    ({"tools": ["greet"]}, ALICE, {"deploy", "greet"}),
    ({"tools": ["*"]}, ALICE, {"deploy", "wipe", "greet"}),
    ({"roles": ["intern"]}, INTERN, {"deploy", "wipe", "greet"}),
    ({"roles": ["intern"]}, ALICE, {"deploy"}),
    ({"roles": ["intern"], "exempt_roles": ["automation"]}, BOT, set()),  # exempt wins
    ({"tools": ["*"], "exempt_roles": ["automation"]}, BOT, set()),
])
def test_which_runs_need_approval(policy: dict[str, object], principal: Principal,
                                  wanted: set[str]) -> None:
    decided = rules(**policy)
    assert {spec.name for spec in (DEPLOY, WIPE, GREET)  # type: ignore[union-attr]
            if decided.required(spec, principal)} == wanted  # type: ignore[arg-type]


def test_the_policy_refuses_unknown_keys() -> None:
    with pytest.raises(ValueError):
        Settings(approval_policy={"tool": ["x"]})
    with pytest.raises(ValueError):
        Settings(approval_timeout_seconds=0)


def test_a_malformed_decision_names_every_bad_field() -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_decision("", "id\n", 0, "x" * 1001, "nothex")
    assert [v.field for v in refused.value.violations] == [
        "run_id", "approval_id", "decision", "reason", "arguments_digest"]
    check_decision("run", "id", 1, "line one\nline two\ttabbed", "a" * 64)  # all fine


def _record(run_id: str = "r1") -> ApprovalRecord:
    return ApprovalRecord(run_id=run_id, approval_id="secret-id", tool="deploy",
                          owner="alice", principal="alice", digest="d" * 64, arguments="{}",
                          requested_ms=now_ms(), deadline_ms=now_ms() + 60_000)


async def test_the_memory_store_decides_once_and_wakes_its_waiter() -> None:
    store = MemoryApprovalStore()
    assert await store.decide("r1", "secret-id", "", APPROVED, "bob", "") == (MISSING, None)
    await store.put(_record(), 60_000)
    waiter = asyncio.ensure_future(store.wait("r1", 30))
    assert (await store.decide("r1", "guess", "", APPROVED, "bob", ""))[0] == ID_MISMATCH
    assert (await store.decide("r1", "secret-id", "e" * 64, APPROVED, "bob", ""))[0] == \
        DIGEST_MISMATCH
    answer, decided = await store.decide("r1", "secret-id", "d" * 64, DENIED, "bob", "no")
    assert answer == DECIDED and decided is not None and decided.decided_ms > 0
    assert (await store.decide("r1", "secret-id", "", APPROVED, "carol", ""))[0] == NOT_PENDING
    woken = await asyncio.wait_for(waiter, 5)
    assert woken is not None and (woken.state, woken.approver, woken.reason) == (
        DENIED, "bob", "no")
    settled = await store.settle("r1", TIMED_OUT, "late")  # a decision that came first stands
    assert settled is not None and settled.state == DENIED


async def test_the_memory_store_forgets_expired_records() -> None:
    store = MemoryApprovalStore()
    await store.put(_record("old"), 1)
    await asyncio.sleep(0.01)
    await store.put(_record("new"), 60_000)
    assert await store.get("old") is None
    assert set(await store.get_many(["old", "new", "none"])) == {"new"}
    pending = await store.wait("new", 0.01)  # no decision: still pending at the timeout
    assert pending is not None and pending.pending


def test_a_record_survives_its_text_form() -> None:
    record = _record()
    fields = record.as_fields()
    assert ApprovalRecord.from_fields(fields) == record
    assert "secret-id" not in fields["id_hash"] and len(fields["id_hash"]) == 64
