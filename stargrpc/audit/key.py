"""The audit key: the secret the hash chain is keyed with (HMAC-SHA-256).

Without a key, whoever can write the database can change a record and recompute the hash of
it and of every record after it: ``verify`` would pass. With the key, that takes the key
too, and the key is kept outside the database (``audit_hmac_key_file``). A key kept in the
same state folder as a SQLite trail protects the trail from those who can write the
database but not read that folder's key (a copy, a backup, a restore, a SQL client); keep
it elsewhere (a secret mounted read-only) to protect the trail from whoever can write the
state folder.

The key file holds at least 32 bytes of secret (surrounding white space is ignored), as
made by ``openssl rand -hex 32``. Each record names its key by :attr:`ChainKey.id`, a
digest of the key that reveals nothing of it, so that ``verify`` can say which key a
record needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stargrpc.settings import Settings

#: The shortest secret accepted, in bytes.
MIN_KEY_BYTES = 32


class AuditKeyError(Exception):
    """The audit key file cannot be read, or holds no usable key."""


@dataclass(frozen=True)
class ChainKey:
    """A key of the audit chain.

    Attributes:
        id: A digest of the secret, recorded with each record it keys (16 hex digits).
        secret: The secret itself (never shown).
    """

    id: str
    secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> ChainKey:
        """The key of ``secret``.

        Raises:
            AuditKeyError: The secret is shorter than :data:`MIN_KEY_BYTES`.
        """
        if len(secret) < MIN_KEY_BYTES:
            raise AuditKeyError(f"an audit key needs at least {MIN_KEY_BYTES} bytes of "
                                f"secret (e.g. openssl rand -hex 32), not {len(secret)}")
        digest = hashlib.sha256(b"stargrpc audit key id\0" + secret).hexdigest()
        return cls(id=digest[:16], secret=secret)


def make_private_folders(folder: Path) -> None:
    """Creates ``folder`` and the folders above it that do not exist yet, mode 0700 (those
    that exist are left as they are)."""
    for missing in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            missing.mkdir(mode=0o700)


def default_key_path(state_dir: Path) -> Path:
    """The key file used when ``audit_hmac_key_file`` is not set."""
    return state_dir / "audit-hmac.key"


def audit_key_path(settings: Settings) -> Path:
    """The server's audit key file: ``audit_hmac_key_file``, else the default one."""
    return settings.audit_hmac_key_file or default_key_path(settings.state_dir)


def load_key(path: Path) -> ChainKey:
    """The key in ``path``.

    Raises:
        AuditKeyError: The file cannot be read or holds too short a secret.
    """
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise AuditKeyError(f"cannot read the audit key file {path}: {exc.strerror}") from exc
    try:
        return ChainKey.from_secret(secret)
    except AuditKeyError as exc:
        raise AuditKeyError(f"{path}: {exc}") from None


def load_or_create_key(path: Path) -> ChainKey:
    """The key in ``path``, made first (a random secret, mode 0600, folders 0700) when
    the file does not exist.

    Raises:
        AuditKeyError: The file cannot be made or read, or holds too short a secret.
    """
    if path.exists():
        return load_key(path)
    try:
        make_private_folders(path.parent)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".audit-key-")  # mode 0600
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(secrets.token_hex(32) + "\n")
                out.flush()
                os.fsync(out.fileno())
            # A link appears whole or not at all, and fails if the file exists: of two
            # processes starting at once, one makes the key and the other reads it.
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
        finally:
            Path(temp).unlink(missing_ok=True)
    except OSError as exc:
        raise AuditKeyError(f"cannot create the audit key file {path}: "
                            f"{exc.strerror}") from exc
    return load_key(path)
