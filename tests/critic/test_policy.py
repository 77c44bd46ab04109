"""The supervision policy of a call: the server's timeouts, and the caller's deadline."""

from __future__ import annotations

import asyncio

from stargrpc.critic.supervision import SupervisionPolicy
from stargrpc.settings import Settings


async def test_a_call_without_a_deadline_gets_the_servers_timeouts_as_they_are_now() -> None:
    settings = Settings(critic_soft_timeout=7.0, critic_hard_timeout=70.0)
    policy = SupervisionPolicy.for_call(settings)
    assert policy == SupervisionPolicy(7.0, 70.0, None)
    assert SupervisionPolicy.for_call(settings, None) == policy

    other = Settings(critic_soft_timeout=8.0, critic_hard_timeout=70.0)
    assert SupervisionPolicy.for_call(other) == SupervisionPolicy(8.0, 70.0, None)
    assert SupervisionPolicy.for_call(settings) == policy  # each server keeps its own


async def test_a_callers_deadline_is_an_event_loop_time() -> None:
    settings = Settings(critic_soft_timeout=7.0, critic_hard_timeout=70.0)
    before = asyncio.get_running_loop().time()
    policy = SupervisionPolicy.for_call(settings, 5.0)
    after = asyncio.get_running_loop().time()
    assert (policy.soft_timeout, policy.hard_timeout) == (7.0, 70.0)
    assert policy.deadline is not None and before + 5.0 <= policy.deadline <= after + 5.0
