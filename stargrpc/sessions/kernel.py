"""The session kernel: the program a session runs inside its sandbox.

It is started as ``python3 -I -u -c <this file's source>`` by :mod:`stargrpc.sessions.session`
and imports nothing of stargrpc (the sandbox sees only the system's Python). It speaks the
protocol of :mod:`stargrpc.sessions.protocol` on the two descriptors it was started with
(stdin from the server, stdout to the server), which it moves out of the way first:

- fd 0 becomes ``/dev/null``; fds 1 and 2 become pipes that a relay thread reads and sends
  to the server as ``out`` frames. Whatever the code run in the session writes to its
  stdout or stderr (``print``, ``os.write(1, …)``, a subprocess) is therefore data inside a
  frame, never a frame: it cannot end a call or forge a result.
- Only the kernel holds the control descriptors (not inheritable, closed in any process
  forked from the kernel, which exits once its code is done rather than return here), and
  each ``done`` frame repeats the call's random id, which the server checks.

Code that means to subvert its own kernel (it runs in the same process) can do so: it can
at most lie about its own session's calls, to its own owner. The server treats every frame
as untrusted input (bounded size, checked shape, id checked) and measures what a session
used itself, from ``/proc``.

Frames from the server: ``{"t": "python", "call": id, "code": str}``, ``{"t": "shell",
"call": id, "command": str}``, ``{"t": "interrupt", "call": id}``. Frames to the server:
``{"t": "ready"}``, ``{"t": "out", "ch": "stdout"|"stderr", "data": str}``,
``{"t": "done", "call": id, "ok": bool, "value": …, "repr": str, "error": str,
"exit_status": int, "signal": int}``.
"""

import ast
import builtins
import codecs
import contextlib
import fcntl
import io
import json
import os
import queue
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback

#: A surrogate code point: in a str, always a lone one (a pair is one character).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _spelt_out(match):
    """A lone surrogate as the JSON text of its escape, backslash included."""
    return f"\\\\u{ord(match.group()):04x}"


#: Largest frame either way (the server enforces the same bound).
MAX_FRAME = 1 << 20
#: Bytes of output read per frame.
CHUNK = 16 * 1024
#: Longest JSON (or repr) of a final expression's value sent back.
MAX_VALUE = 64 * 1024
#: Output drained at a call's end at most, per stream (a writer that never stops).
MAX_DRAIN = 4 << 20

#: How often, and how many times at most, an interrupt is signalled again while the call it
#: is for has not taken it (2 s: the server's grace before it closes the session).
INTERRUPT_EVERY = 0.05
INTERRUPT_TIMES = 40

_HEADER = struct.Struct(">I")


class Kernel:
    """One session's interpreter: runs each call's code and relays its output."""

    def __init__(self, ctrl_in, ctrl_out, out_r, err_r):
        self.pid = os.getpid()
        # The thread that runs the calls (and Python's signal handlers): interrupts are
        # aimed at it (see _interrupt).
        self.main_thread = threading.get_ident()
        self.ctrl_in = ctrl_in
        self.ctrl_out = ctrl_out
        self.pipes = {out_r: "stdout", err_r: "stderr"}
        self.decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace")
                         for fd in self.pipes}
        self.send_lock = threading.Lock()
        self.relay_lock = threading.Lock()
        self.calls: queue.Queue[dict] = queue.Queue()
        self.current = None  # the id of the call running now
        self.shell = None  # the shell of a shell call running now
        # Calls interrupted before they started (their frame still queued: the interrupt
        # came right behind it), never to run; and the lock that makes "started" and
        # "interrupted before starting" exclusive.
        self.interrupted = set()
        self.interrupt_lock = threading.Lock()
        # The running call asked to stop and not told yet (its KeyboardInterrupt not raised),
        # and whether the running call has ended.
        self.interrupting = None
        self.call_over = threading.Event()
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.sweeps = os.environ.get("STARGRPC_SESSION_SWEEP") == "1"
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self):
        # A process forked by the session's code must never speak for the kernel.
        for fd in (self.ctrl_in, self.ctrl_out):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ctrl_in = self.ctrl_out = -1

    # -- frames ---------------------------------------------------------------------------

    def send(self, frame):
        text = json.dumps(frame, ensure_ascii=False)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            # A str holding a lone surrogate (a name read with surrogateescape, say) has no
            # UTF-8 form: its escape goes spelt out as text (a JSON "\\udcff"), as the
            # server writes such text everywhere — not "?", which merged keys that differ.
            data = _LONE_SURROGATE.sub(_spelt_out, text).encode("utf-8")
        if len(data) > MAX_FRAME:
            data = json.dumps({"t": "error", "error": "frame too large"}).encode()
        with self.send_lock:
            view = memoryview(_HEADER.pack(len(data)) + data)
            while view:
                written = os.write(self.ctrl_out, view)
                view = view[written:]

    def _read_exactly(self, size):
        parts = []
        while size:
            chunk = os.read(self.ctrl_in, min(size, 1 << 16))
            if not chunk:
                raise EOFError
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def read_frames(self):
        """The control thread: queues calls, interrupts the running one; the server gone
        (end of file) ends the kernel."""
        try:
            while True:
                (size,) = _HEADER.unpack(self._read_exactly(_HEADER.size))
                if size > MAX_FRAME:
                    break
                frame = json.loads(self._read_exactly(size))
                if frame.get("t") == "interrupt":
                    self._interrupt(frame.get("call"))
                else:
                    self.calls.put(frame)
        except (EOFError, OSError, ValueError):
            pass
        os._exit(0)

    def _interrupt(self, call):
        if call is None:
            return
        with self.interrupt_lock:
            if call != self.current:
                # Not started yet (or ended): a queued call is skipped when its turn comes.
                self.interrupted.add(call)
                return
            self.interrupting = call
        shell = self.shell
        if shell is not None:
            _kill_group(shell.pid)
            return
        # SIGINT at the thread that runs the call (a process-directed signal may be taken
        # by another thread, which interrupts none of the call's system calls), and again
        # until the call has taken it: this thread gets to run when the call's thread lets
        # go of the GIL — as it is about to block in a system call (a sleep, a read) — and a
        # signal that lands before the system call starts is only noted by Python, which
        # runs the handler once the call returns; the call slept on past the grace, and the
        # session was closed as one that would not stop (seen: about 1 cancel in 100).
        # Only the kernel's own handler is signalled again: a handler the call's code
        # installed gets the interrupt once and decides what it means.
        for attempt in range(INTERRUPT_TIMES):
            if self.interrupting != call:
                return  # taken
            if attempt and signal.getsignal(signal.SIGINT) != self._on_interrupt:
                return
            signal.pthread_kill(self.main_thread, signal.SIGINT)
            if self.call_over.wait(INTERRUPT_EVERY):
                return

    # -- output ---------------------------------------------------------------------------

    def relay(self):
        """The relay thread: sends what the session's processes write, as it comes."""
        while True:
            ready, _, _ = select.select(list(self.pipes), [], [])
            with self.relay_lock:
                for fd in ready:
                    self._forward(fd, CHUNK)

    def _forward(self, fd, limit):
        """Reads up to ``limit`` bytes now in ``fd`` and sends them; returns how many."""
        try:
            data = os.read(fd, limit)
        except BlockingIOError:
            return 0
        text = self.decoders[fd].decode(data)
        if text:
            self.send({"t": "out", "ch": self.pipes[fd], "data": text})
        return len(data)

    def drain(self):
        """Sends every byte written to stdout/stderr so far, before a call's ``done``."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd in self.pipes:
            sent = 0
            while sent < MAX_DRAIN:
                read = self._forward(fd, CHUNK)
                if not read:
                    break
                sent += read

    # -- calls ----------------------------------------------------------------------------

    def _on_interrupt(self, signum, frame):
        # Only the call asked to stop is interrupted, once per request (the signal may be
        # repeated until it is taken); one that ended meanwhile, and the next, are left
        # alone.
        if (self.current is not None and self.current == self.interrupting
                and self.shell is None):
            self.interrupting = None
            raise KeyboardInterrupt

    def serve(self):
        signal.signal(signal.SIGINT, self._on_interrupt)
        threading.Thread(target=self.read_frames, daemon=True).start()
        threading.Thread(target=self.relay, daemon=True).start()
        self.send({"t": "ready", "pid": self.pid})
        while True:
            frame = self.calls.get()
            call = frame.get("call")
            with self.interrupt_lock:
                self.call_over.clear()
                self.current = call
                self.interrupting = None
                early = call in self.interrupted
                # One call at a time: any other id is of a call that ended (its interrupt
                # raced its done frame) and will never start.
                self.interrupted.clear()
            try:
                if early:
                    raise KeyboardInterrupt
                if frame.get("t") == "python":
                    done = self.run_python(str(frame.get("code", "")))
                else:
                    done = self.run_shell(str(frame.get("command", "")))
            except KeyboardInterrupt:
                done = {"ok": False, "error": "KeyboardInterrupt"}
            finally:
                self.current = None
                self.call_over.set()
                self.shell = None
            self.sweep()
            done.update(t="done", call=call)
            with self.relay_lock:
                self.drain()
                self.send(done)

    def sweep(self):
        """Ends every process a call left behind (its processes end with it), when the
        kernel is alone in a PID namespace of the session's own (``STARGRPC_SESSION_SWEEP``):
        ``kill(-1)`` there reaches the session's processes and nothing else."""
        if self.sweeps:
            for _ in range(200):  # a fork bomb refills as it is killed: until none is left
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
                except OSError:
                    break
                _reap()
            _reap(wait=1.0)  # SIGKILL lands asynchronously: the last ones die after it
        else:
            _reap()

    def run_python(self, code):
        try:
            tree = ast.parse(code, "<session>", "exec")
        except SyntaxError:
            traceback.print_exc(limit=0)
            return {"ok": False, "error": _summary(sys.exc_info()[1])}
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        value = None
        try:
            exec(compile(tree, "<session>", "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, "<session>", "eval"), self.namespace)
        except BaseException as exc:  # the code's own failure, SystemExit included
            if os.getpid() != self.pid:
                os._exit(1)
            _print_user_traceback(exc)
            return {"ok": False, "error": _summary(exc)}
        finally:
            if os.getpid() != self.pid:
                os._exit(0)  # a process the code forked: its code is done
        done: dict = {"ok": True}
        if value is not None:
            try:
                text = json.dumps(value, ensure_ascii=False, allow_nan=False)
                if len(text) <= MAX_VALUE:
                    done["value"] = value
            except (TypeError, ValueError, RecursionError):
                pass
            try:
                done["repr"] = repr(value)[:MAX_VALUE]
            except Exception as exc:
                done["repr"] = f"<repr failed: {_summary(exc)}>"
        return done

    def run_shell(self, command):
        try:
            self.shell = subprocess.Popen(["sh", "-c", command], stdin=subprocess.DEVNULL,
                                          stdout=1, stderr=2, start_new_session=True)
        except OSError as exc:
            print(f"cannot start sh: {exc}", file=sys.stderr)
            return {"ok": False, "error": str(exc), "exit_status": 127}
        status = self.shell.wait()
        # Background jobs of the command end with it.
        _kill_group(self.shell.pid)
        if status < 0:
            return {"ok": False, "signal": -status,
                    "error": f"killed by signal {signal.Signals(-status).name}"}
        return {"ok": status == 0, "exit_status": status,
                "error": "" if status == 0 else f"exited with status {status}"}


def _reap(wait=0.0):
    """Reaps exited children (and, as a PID namespace's init, the orphans it inherited):
    a zombie still counts against the session's process limit. With ``wait``, waits up to
    that many seconds for children that were killed and are not gone yet."""
    deadline = time.monotonic() + wait
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def _kill_group(pgid):
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _summary(exc):
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-2000:]


def _print_user_traceback(exc):
    # The kernel's own frames are of no interest to the session's owner.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<session>":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


#: prctl option: orphaned descendants are re-parented to the caller (Linux 3.4+).
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper():
    """Makes the kernel the parent of every orphan among its descendants, so that it reaps
    them itself (:meth:`Kernel.sweep`) instead of leaving them to the namespace's init."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def main():
    _become_subreaper()
    ctrl_in = os.dup(0)
    ctrl_out = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    readers = []
    for target in (1, 2):
        read_end, write_end = os.pipe()
        os.dup2(write_end, target)
        os.close(write_end)
        fcntl.fcntl(read_end, fcntl.F_SETFL, fcntl.fcntl(read_end, fcntl.F_GETFL)
                    | os.O_NONBLOCK)
        readers.append(read_end)
    # Line-buffered, not write-through: a print() reaches the pipe as one whole line.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True,
                                  write_through=False)
    Kernel(ctrl_in, ctrl_out, *readers).serve()


if __name__ == "__main__":
    main()
