"""A custom tool that uses ``ctx.session``: writes a note into the session's folder."""

from __future__ import annotations

from pydantic import BaseModel

from stargrpc import ToolContext, tool


class NoteArgs(BaseModel):
    text: str


@tool()
async def session_note(ctx: ToolContext, args: NoteArgs) -> dict:
    """Writes `text` to note.txt in the session's folder; says which session it was."""
    if ctx.session is None:
        return {"session_id": None}
    try:
        ctx.session.write_file("note.txt", args.text)
    except OSError as exc:
        return {"session_id": ctx.session.session_id, "refused": type(exc).__name__}
    return {"session_id": ctx.session.session_id, "kind": ctx.session.kind,
            "read_back": ctx.session.read_file("note.txt").decode()}
