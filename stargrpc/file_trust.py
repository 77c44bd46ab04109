"""Whether a file the server takes credentials from may hold what another user wrote.

A keys file, a JWT key or secret file, a client CA: whoever may write one could put a key,
a secret or a CA of their own in it, and so make themselves any principal. Only the
server's own user and root may (a Kubernetes secret is root's); a file writable by every
user, or owned by anyone else, is refused where it is read.
"""

from __future__ import annotations

import os
import stat


def others_may_write(info: os.stat_result) -> str | None:
    """Why the file of ``info`` (its ``stat``) may hold what another user wrote: any user
    may write it, or another user owns it. None when neither."""
    if info.st_mode & stat.S_IWOTH:
        return "is writable by every user"
    if info.st_uid not in (0, os.geteuid()):
        return f"belongs to another user (uid {info.st_uid})"
    return None
