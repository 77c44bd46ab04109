"""API keys: a local JSON file of key *hashes*; the keys themselves are shown once.

A key looks like ``sgk_<id>_<secret>``: the id (12 hex digits) finds the record, the
secret carries 256 random bits. With that much entropy a plain SHA-256 of the whole key is
as strong as a slow KDF and keeps verification cheap on every call; the digest is compared
in constant time. Writers (the ``stargrpc keys`` commands) take a lock file and replace the
file atomically; a running server re-reads it whenever it changes, so a revocation takes
effect on the next call without a restart.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stargrpc.errors import CredentialsRejected, KeysFileError
from stargrpc.file_trust import others_may_write

#: Every key starts with this, so secret scanners and people can recognise one.
KEY_PREFIX = "sgk_"
_KEY_SHAPE = re.compile(r"sgk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
_ID_SHAPE = re.compile(r"[0-9a-f]{12}")
_NAME_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
_ROLE_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}")
# Compared against when the key id is unknown, so a miss costs the same as a wrong secret.
_DUMMY_DIGEST = "sha256:" + "0" * 64


class ApiKey(BaseModel):
    """One stored key: everything but the key itself.

    Attributes:
        id: Public identifier, part of the key.
        name: The principal id the key authenticates as.
        roles: Roles granted to the key.
        hash: ``sha256:<hex>`` of the whole key.
        created_at: When it was created (UTC).
        revoked_at: When it was revoked, if it was.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    name: str
    roles: tuple[str, ...] = ()
    hash: str
    created_at: datetime
    revoked_at: datetime | None = None

    @property
    def revoked(self) -> bool:
        """Whether the key has been revoked."""
        return self.revoked_at is not None


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    keys: list[ApiKey] = Field(default_factory=list)


def digest(key: str) -> str:
    """The stored form of ``key``."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    """Refuses a keys file others may have written (a key with any role could have been
    added to it).

    Raises:
        KeysFileError: It is such a file.
    """
    why = others_may_write(info)
    if why is not None:
        raise KeysFileError(f"keys file {path} {why}, who could add a key of any role: "
                            "refused (make it the server's user's, mode 600)")


class KeyStore:
    """The keys file at ``path``; reads are cached until the file changes."""

    path: Path
    _path: str
    _stamp: tuple[int, int, int] | None
    _by_id: dict[str, ApiKey]

    def __init__(self, path: Path) -> None:
        self.path = path
        self._path = os.fspath(path)
        self._stamp = None
        self._by_id = {}

    # -- reading ---------------------------------------------------------------------------

    def records(self) -> list[ApiKey]:
        """Every key in the file, revoked ones included, oldest first.

        Raises:
            KeysFileError: The file exists but is unreadable or malformed.
        """
        self._refresh()
        return list(self._by_id.values())

    def verify(self, presented: str) -> ApiKey:
        """The live key ``presented`` is.

        Raises:
            CredentialsRejected: Malformed, unknown, wrong or revoked (the cause is for the
                server log and metrics only; callers all see the same UNAUTHENTICATED).
        """
        match = _KEY_SHAPE.fullmatch(presented)
        if match is None:
            raise CredentialsRejected("malformed_key")
        try:
            self._refresh()
        except KeysFileError:
            if self._stamp is None:  # never read successfully: nothing to verify against
                raise CredentialsRejected("keys_unavailable") from None
            # Otherwise keep serving with the last good copy; the error is logged by whoever
            # edits the file (and `keys list` shows it).
        record = self._by_id.get(match.group(1))
        good = hmac.compare_digest(digest(presented),
                                   record.hash if record is not None else _DUMMY_DIGEST)
        if record is None or not good:
            raise CredentialsRejected("unknown_key")
        if record.revoked:
            raise CredentialsRejected("revoked_key")
        return record

    def _refresh(self) -> None:
        try:
            info = os.stat(self._path)  # a str: cheaper than Path.stat, once per call
        except FileNotFoundError:
            self._stamp, self._by_id = (0, 0, 0), {}
            return
        except OSError as exc:
            raise KeysFileError(f"cannot read keys file {self.path}: {exc.strerror}") from exc
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        if stamp == self._stamp:
            return
        parsed = self._read()
        self._by_id = {key.id: key for key in parsed.keys}
        self._stamp = stamp

    def _read(self) -> _KeysFile:
        try:
            with open(self._path, encoding="utf-8") as file:
                _check_owner_and_mode(self.path, os.fstat(file.fileno()))
                text = file.read()
        except FileNotFoundError:
            return _KeysFile()
        except OSError as exc:
            raise KeysFileError(f"cannot read keys file {self.path}: {exc.strerror}") from exc
        try:
            return _KeysFile.model_validate_json(text)
        except ValidationError as exc:
            raise KeysFileError(f"keys file {self.path} is malformed: "
                                f"{exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from exc

    # -- writing ---------------------------------------------------------------------------

    def create(self, name: str, roles: Iterable[str]) -> tuple[ApiKey, str]:
        """Creates a key for ``name`` with ``roles``.

        Returns:
            The stored record and the key itself (which is stored nowhere).

        Raises:
            KeysFileError: A bad name or role, a live key of that name exists, or the file
                cannot be written.
        """
        created = self._create(name, roles, only_if_empty=False)
        assert created is not None
        return created

    def create_first(self, name: str, roles: Iterable[str]) -> tuple[ApiKey, str] | None:
        """Like :meth:`create`, but only when the file holds no key at all (not even a
        revoked one); checked under the lock, so two processes starting at once make one."""
        return self._create(name, roles, only_if_empty=True)

    def _create(self, name: str, roles: Iterable[str], *, only_if_empty: bool
                ) -> tuple[ApiKey, str] | None:
        roles = tuple(dict.fromkeys(roles))
        if not _NAME_SHAPE.fullmatch(name):
            raise KeysFileError(f"bad key name {name!r}: 1-64 letters, digits and ._@:- "
                                "starting with a letter or digit")
        if _ID_SHAPE.fullmatch(name):
            # `keys revoke` takes a name or an id: this name would be another key's id too.
            raise KeysFileError(f"bad key name {name!r}: 12 hex digits are a key id")
        for role in roles:
            if not _ROLE_SHAPE.fullmatch(role):
                raise KeysFileError(f"bad role {role!r}: 1-64 letters, digits and ._:/- "
                                    "starting with a letter or digit")
        with self._locked() as data:
            if only_if_empty and data.keys:
                return None
            if any(k.name == name and not k.revoked for k in data.keys):
                raise KeysFileError(f"a live key named {name!r} exists; revoke it first")
            key_id = secrets.token_hex(6)
            key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
            record = ApiKey(id=key_id, name=name, roles=roles, hash=digest(key),
                            created_at=datetime.now(UTC))
            data.keys.append(record)
        return record, key

    def revoke(self, name_or_id: str) -> list[ApiKey]:
        """Revokes the live keys whose id or name is ``name_or_id``.

        Returns:
            The keys revoked (none when nothing live matched).
        """
        revoked = []
        with self._locked() as data:
            now = datetime.now(UTC)
            for index, key in enumerate(data.keys):
                if name_or_id in (key.id, key.name) and not key.revoked:
                    data.keys[index] = key.model_copy(update={"revoked_at": now})
                    revoked.append(data.keys[index])
        return revoked

    @contextmanager
    def _locked(self) -> Iterator[_KeysFile]:
        """The file's content under an exclusive lock; written back atomically on exit."""
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = os.open(str(self.path) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as exc:
            raise KeysFileError(f"cannot write keys file {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read()
            yield data
            self._write(data)
        finally:
            os.close(lock)

    def _write(self, data: _KeysFile) -> None:
        text = data.model_dump_json(indent=2) + "\n"
        try:
            fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".keys-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:  # mkstemp: mode 0600
                    out.write(text)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temp, self.path)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise KeysFileError(f"cannot write keys file {self.path}: {exc.strerror}") from exc
