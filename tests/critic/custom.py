"""Critics and tools of the critic tests (loaded by name: ``tests.critic.custom:make``)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool
from stargrpc.critic import Extend, RunJudge, RunStart, Steer, Stop, Verdict, VerdictSink, Warn
from stargrpc.v1 import events_pb2


class WordJudge(RunJudge):
    """Judges a run by the words it says."""

    def observe(self, event: events_pb2.RunEvent) -> Verdict | None:
        said = event.step.delta if event.HasField("step") else ""
        if "forbidden" in said:
            return Stop("FORBIDDEN_WORD", "it said the forbidden word")
        if "careful" in said:
            return Warn("it is being careful")
        if "lost" in said:
            return Steer("turn left")
        if "more" in said:
            return Extend(30, reason="it asked for more")
        return None


class WordCritic:
    """Stops a run that says "forbidden", warns on "careful", steers on "lost", extends on
    "more"; otherwise never extends (a run stops at its first soft deadline)."""

    name = "words"

    def judge(self, start: RunStart, verdicts: VerdictSink) -> WordJudge:
        del start, verdicts
        return WordJudge()


def make() -> WordCritic:
    """The factory ``--critic tests.critic.custom:make`` calls."""
    return WordCritic()


class Crashing(RunJudge):
    def observe(self, event: events_pb2.RunEvent) -> Verdict | None:
        if event.HasField("step") and event.step.delta:
            raise RuntimeError("the critic's own bug")
        return None


class CrashingCritic:
    """A critic whose judge raises on the first delta."""

    name = "crashing"

    def judge(self, start: RunStart, verdicts: VerdictSink) -> Crashing:
        del start, verdicts
        return Crashing()


#: What the malformed critic answers when the run says the word: verdicts of the right
#: class whose fields are not what they must be.
MALFORMED: dict[str, Verdict] = {
    "warn_none": Warn(None),  # type: ignore[arg-type]
    "extend_text": Extend("5"),  # type: ignore[arg-type]
    "stop_number": Stop(5, "why"),  # type: ignore[arg-type]
    "steer_bytes": Steer(b"turn left"),  # type: ignore[arg-type]
    "quiet_nan": Extend(float("nan"), quiet=True),
    "quiet_negative": Extend(-5.0, quiet=True),
}


class MalformedJudge(RunJudge):
    def observe(self, event: events_pb2.RunEvent) -> Verdict | None:
        if event.HasField("step"):
            return MALFORMED.get(event.step.delta)
        return None


class MalformedCritic:
    """A critic that answers a malformed verdict to each word of :data:`MALFORMED`."""

    name = "malformed"

    def judge(self, start: RunStart, verdicts: VerdictSink) -> MalformedJudge:
        del start, verdicts
        return MalformedJudge()


def malformed() -> MalformedCritic:
    """The factory of ``tests.critic.custom:malformed``."""
    return MalformedCritic()


class ExitingJudge(RunJudge):
    def __init__(self, where: str) -> None:
        self.where = where

    def observe(self, event: events_pb2.RunEvent) -> Verdict | None:
        if self.where == "observe" and event.step.phase == events_pb2.STEP_PHASE_END:
            raise SystemExit(7)  # as the run ends: its steps' ENDs
        return None

    def close(self) -> None:
        if self.where == "close":
            raise KeyboardInterrupt


class ExitingCritic:
    """A critic that calls sys.exit() (or is interrupted) ``where``: judge, observe, close."""

    name = "exiting"

    def __init__(self, where: str) -> None:
        self.where = where

    def judge(self, start: RunStart, verdicts: VerdictSink) -> ExitingJudge:
        del start, verdicts
        if self.where == "judge":
            raise SystemExit(6)
        return ExitingJudge(self.where)


def judged_by_an_exit(where: str) -> object:
    """A tool named ``exits_in_<where>`` under an :class:`ExitingCritic`."""

    async def fn(ctx: ToolContext) -> str:
        await ctx.delta("still here")
        return "survived"

    fn.__name__ = fn.__qualname__ = f"exits_in_{where}"
    fn.__doc__ = f"Says something under a critic that exits in {where}."
    return tool(critic=ExitingCritic(where))(fn)


class NotACritic:
    """What a factory that returns the wrong thing returns."""


class Words(BaseModel):
    words: list[str] = Field(max_length=50)
    pause: float = Field(0.0, ge=0, le=5)


@tool()
async def says(ctx: ToolContext, args: Words) -> str:
    """Says each word as a delta, pausing between them, then waits to be stopped when the
    last word is "wait"."""
    for word in args.words:
        if word == "wait":
            await asyncio.Event().wait()
        await ctx.delta(word)
        await asyncio.sleep(args.pause)
    return "said"


@tool(critic="tests.critic.custom:make")
async def judged_by_words(ctx: ToolContext) -> str:
    """Says the forbidden word, under its own critic."""
    await ctx.delta("forbidden")
    await asyncio.Event().wait()
    return "unreachable"


@tool(critic=CrashingCritic())
async def judged_by_a_crash(ctx: ToolContext) -> str:
    """Says something slowly, under a critic that crashes."""
    for i in range(5):
        await ctx.delta(f"word {i}")
        await asyncio.sleep(0.05)
    return "survived"
