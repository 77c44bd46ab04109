"""The critic: who judges a run, and the supervision that applies its verdicts.

- :mod:`stargrpc.critic.base` — the :class:`Critic` protocol, the :class:`RunStart` view and
  the verdicts (:class:`Extend`, :class:`Warn`, :class:`Steer`, :class:`Stop`, :class:`Keep`);
- :mod:`stargrpc.critic.rules` — the default critic: progress restarts the soft deadline;
- :mod:`stargrpc.critic.supervision` — the per-run driver: timers, verdicts, the hard cap and
  the caller's deadline no critic may pass, the fallback to the rules;
- :mod:`stargrpc.critic.remote` — a critic reached over gRPC (``CriticService``);
- :mod:`stargrpc.critic.loading` — ``module:factory``, the ``stargrpc.critics`` entry points,
  per-tool ``@tool(critic=…)``.

A critic of your own::

    from stargrpc.critic import Critic, Extend, RunJudge, RunStart, Stop

    class Patient(RunJudge):
        def observe(self, event):
            if event.HasField("heartbeat"):
                return Extend(600, reason="still alive")
            return None

    class PatientCritic:
        name = "patient"

        def judge(self, start: RunStart, verdicts) -> RunJudge:
            return Patient()

and ``stargrpc serve --critic mymodule:PatientCritic``.
"""

from __future__ import annotations

from stargrpc.critic.base import (
    Critic,
    CriticError,
    Extend,
    Keep,
    RunJudge,
    RunStart,
    Steer,
    Stop,
    Verdict,
    VerdictSink,
    Warn,
)

__all__ = [
    "Critic",
    "CriticError",
    "Extend",
    "Keep",
    "RunJudge",
    "RunStart",
    "Steer",
    "Stop",
    "Verdict",
    "VerdictSink",
    "Warn",
]
