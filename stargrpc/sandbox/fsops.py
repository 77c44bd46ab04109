"""What the server does on a run's working directory, relative to file descriptors only.

A sandboxed command owns its working directory and may rearrange it at will: replace
``out/`` by a symlink to the server's state folder, plant FIFOs, hard links, 1,200 nested
folders, folders it made unreadable. Everything here therefore starts from a directory fd
the server opened itself and goes down one name at a time with ``O_NOFOLLOW`` and
``dir_fd=``; an entry is used only if ``fstat`` shows the expected type, owner, a single
link and the run folder's device (so no bind mount or symlink can point the server at
anything outside). A file is first opened with ``O_PATH`` (which neither reads it, nor
blocks on a FIFO, nor drops the POSIX locks another descriptor holds on it, as SQLite's
are) and reopened for reading only after those checks.

The walks are iterative (no recursion on the Python stack) and hold one directory fd at a
time: they climb back with ``..`` and check it is the folder they came from, so a tree
of any depth costs neither stack nor descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

#: Flags a directory is opened with: never through a symlink in its last part.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: Each entry counts at least this much against the disk cap (a block; also bounds how
#: many empty files or folders a run can make within the cap).
ENTRY_BYTES = 4096


class Moved(Exception):
    """A folder changed place while it was walked (something is still rearranging it)."""


@dataclass(frozen=True)
class Owner:
    """What every entry of a run's tree must match.

    Attributes:
        uid: The owner (the run's user).
        dev: The device of the run folder.
    """

    uid: int
    dev: int

    def is_own(self, info: os.stat_result) -> bool:
        """Whether ``info`` is of an entry the run made in its own tree."""
        return info.st_uid == self.uid and info.st_dev == self.dev


def open_dir(parent_fd: int, name: str, owner: Owner | None = None) -> int:
    """Opens the folder ``name`` of ``parent_fd`` (never through a symlink).

    Raises:
        OSError: It is not a folder (``ENOTDIR``, ``ELOOP`` for a symlink), cannot be
            opened, or (with ``owner``) is not the run's own on the run's device.
    """
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode) or (owner is not None and not owner.is_own(info)):
        os.close(fd)
        raise OSError(errno.ENOTDIR, "not a folder of the run", name)
    return fd


def unlock(parent_fd: int, name: str) -> bool:
    """Gives the folder ``name`` (made unreadable or unwritable by the run) its owner's
    rights back; works as its owner or root, through an ``O_PATH`` fd so never through a
    symlink. Returns whether it did."""
    try:
        fd = os.open(name, _PATH_FLAGS | os.O_DIRECTORY, dir_fd=parent_fd)
    except OSError:
        return False
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _usable(fd: int, unlock: bool) -> os.stat_result:
    """The folder's stat, after (with ``unlock``) giving it its owner's rights back if the
    run took them: needed to list and empty it when the server is not root."""
    info = os.fstat(fd)
    if unlock and info.st_mode & 0o700 != 0o700 and info.st_uid == os.geteuid():
        os.fchmod(fd, 0o700)
    return info


def _names(fd: int) -> list[str]:
    # Reversed, so that popping from the end visits them in order.
    return sorted(os.listdir(fd), reverse=True)


@dataclass
class _Frame:
    ino: int
    names: list[str]
    prefix: str


@dataclass
class _Walk:
    """A depth-first walk below one folder, holding a single directory fd."""

    fd: int
    dev: int
    max_depth: int
    unlock: bool
    frames: list[_Frame] = field(default_factory=list)
    _enter: bool = False

    def __post_init__(self) -> None:
        info = _usable(self.fd, self.unlock)
        self.frames.append(_Frame(info.st_ino, _names(self.fd), ""))

    def entries(self, on_dir_done: Callable[[int, str], None] | None = None
                ) -> Iterator[tuple[str, str, os.stat_result]]:
        """Yields (relative name, name, lstat) of every entry, parents before children;
        the current folder's fd is ``self.fd`` while an entry is handled. A folder is
        entered after it was yielded unless the consumer calls :meth:`skip`. When a folder
        is done, ``on_dir_done(parent_fd, name)`` runs (e.g. to remove it).

        Raises:
            Moved: A folder was moved while walked.
        """
        while self.frames:
            frame = self.frames[-1]
            if not frame.names:
                self._climb(on_dir_done)
                continue
            name = frame.names.pop()
            try:
                info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except (FileNotFoundError, PermissionError):
                continue
            self._enter = stat.S_ISDIR(info.st_mode) and len(self.frames) <= self.max_depth
            yield frame.prefix + name, name, info
            if self._enter:
                self._descend(name, frame.prefix + name + "/")

    def skip(self) -> None:
        """Does not enter the folder just yielded."""
        self._enter = False

    @property
    def too_deep(self) -> bool:
        """Whether the entry just yielded is a folder left unentered for ``max_depth``."""
        return not self._enter and len(self.frames) > self.max_depth

    def _descend(self, name: str, prefix: str) -> None:
        try:
            child = open_dir(self.fd, name)
        except PermissionError:
            if not self.unlock or not unlock(self.fd, name):
                return
            try:
                child = open_dir(self.fd, name)
            except OSError:
                return
        except OSError:
            return
        try:
            info = _usable(child, self.unlock)
            if info.st_dev != self.dev:
                raise OSError(errno.EXDEV, "another device", name)
            names = _names(child)
        except OSError:
            os.close(child)
            return
        os.close(self.fd)
        self.fd = child
        self.frames.append(_Frame(info.st_ino, names, prefix))

    def _climb(self, on_dir_done: Callable[[int, str], None] | None) -> None:
        done = self.frames.pop()
        if not self.frames:
            return
        parent = os.open("..", DIR_FLAGS, dir_fd=self.fd)
        info = os.fstat(parent)
        if info.st_ino != self.frames[-1].ino or info.st_dev != self.dev:
            os.close(parent)
            raise Moved(done.prefix)
        os.close(self.fd)
        self.fd = parent
        if on_dir_done is not None:
            on_dir_done(parent, done.prefix.rstrip("/").rsplit("/", 1)[-1])

    def close(self) -> None:
        """Closes the fd the walk holds."""
        os.close(self.fd)


@contextlib.contextmanager
def walk(dir_fd: int, max_depth: int = 1_000_000, unlock: bool = False) -> Iterator[_Walk]:
    """A walk below ``dir_fd`` (which stays open: the walk works on a duplicate).

    Args:
        dir_fd: The folder.
        max_depth: Folders deeper than this are yielded but not entered.
        unlock: Give folders the run made unreadable or unwritable their owner's rights
            back (only once the run is over: a live run may mean it).
    """
    fd = os.dup(dir_fd)
    try:
        state = _Walk(fd, os.fstat(fd).st_dev, max_depth, unlock)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield state
    finally:
        state.close()


@dataclass(frozen=True)
class Usage:
    """How much a run's tree holds.

    Attributes:
        bytes: Disk space, each entry counted at least :data:`ENTRY_BYTES`; past ``cap``
            the count stops (it is then just over the cap).
        largest_file: Size of the largest regular file seen.
    """

    bytes: int
    largest_file: int


def measure(dir_fd: int, cap: int, unlock: bool = False) -> Usage:
    """The disk space used below ``dir_fd``, counting up to just past ``cap`` (``unlock``:
    see :func:`walk`).

    Raises:
        Moved: Something rearranged the tree while it was measured.
    """
    total = 0
    largest = 0
    with walk(dir_fd, unlock=unlock) as tree:
        for _, _, info in tree.entries():
            total += max(info.st_blocks * 512, ENTRY_BYTES)
            if stat.S_ISREG(info.st_mode):
                largest = max(largest, info.st_size)
            if total > cap:
                break
    return Usage(total, largest)


class TooLarge(Exception):
    """The file is larger than what may still be read."""


def read_own_file(dir_fd: int, name: str, owner: Owner, budget: int) -> bytes | None:
    """The content of ``name`` in ``dir_fd`` if it is a regular file of the run, else None.

    Symlinks, FIFOs, devices, folders, files of another owner or device and hard links
    (``st_nlink`` > 1: a name for a file that lives elsewhere) are refused before the file
    is ever opened for reading.

    Raises:
        TooLarge: It is the run's file but over ``budget`` bytes.
    """
    try:
        path_fd = os.open(name, _PATH_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(path_fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or not owner.is_own(info):
            return None
        if info.st_size > budget:
            raise TooLarge(name)
        # Reopening an O_PATH fd through /proc reaches exactly the inode just checked.
        fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    finally:
        os.close(path_fd)
    with os.fdopen(fd, "rb") as handle:
        again = os.fstat(handle.fileno())
        if (again.st_ino, again.st_dev) != (info.st_ino, info.st_dev):
            return None
        data = handle.read(budget + 1)
    if len(data) > budget:
        raise TooLarge(name)
    return data


#: Passes over a tree before removal gives up (each pass restarts after a :class:`Moved`).
_REMOVE_PASSES = 5


def remove_tree(parent_fd: int, name: str) -> bool:
    """Removes the folder ``name`` of ``parent_fd`` and everything in it.

    Never follows a symlink (a symlink is removed, not what it points to), gives folders
    the run made unreadable or unwritable their rights back, and handles any depth.
    Returns whether the folder is gone.
    """
    for _ in range(_REMOVE_PASSES):
        try:
            top = open_dir(parent_fd, name)
        except FileNotFoundError:
            return True
        except PermissionError:
            unlock(parent_fd, name)
            continue
        except OSError:
            try:
                os.unlink(name, dir_fd=parent_fd)  # not a folder (any more)
            except FileNotFoundError:
                return True
            except OSError:
                continue
            return True
        try:
            _empty(top)
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return True
        except (Moved, OSError):
            continue
        finally:
            os.close(top)
        return True
    return False


def _remove_entry(dir_fd: int, name: str, folder: bool) -> None:
    """Removes one entry of ``dir_fd``; if the run made ``dir_fd`` unwritable, gives it
    its rights back first."""
    remove = os.rmdir if folder else os.unlink
    try:
        remove(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except PermissionError:
        os.fchmod(dir_fd, 0o700)
        with contextlib.suppress(FileNotFoundError):
            remove(name, dir_fd=dir_fd)


def _rmdir(parent_fd: int, name: str) -> None:
    _remove_entry(parent_fd, name, folder=True)


def _empty(dir_fd: int) -> None:
    with walk(dir_fd, unlock=True) as tree:
        # A folder is entered (and emptied) before on_dir_done removes it.
        for _, name, info in tree.entries(on_dir_done=_rmdir):
            if not stat.S_ISDIR(info.st_mode):
                _remove_entry(tree.fd, name, folder=False)
