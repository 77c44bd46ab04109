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
    (ctx.session.folder / "note.txt").write_text(args.text)
    return {"session_id": ctx.session.session_id, "kind": ctx.session.kind}
