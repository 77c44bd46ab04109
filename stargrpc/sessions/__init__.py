"""Sessions: a sandbox kept for one principal across calls (files, a live interpreter).

- :mod:`stargrpc.sessions.registry` — :class:`Sessions`, the sessions of one server: made,
  found for their owner (and for a call: :meth:`Sessions.for_call`), capped, closed on their
  TTL and idle time.
- :mod:`stargrpc.sessions.session` — :class:`Session`, one session: its sandboxed kernel,
  one call at a time, what each call used; :class:`SessionHandle`, a run's ``ctx.session``.
- :mod:`stargrpc.sessions.protocol` — the framed protocol between the server and a kernel.
- :mod:`stargrpc.sessions.kernel` — the kernel itself (runs inside the sandbox).
- :mod:`stargrpc.sessions.tooling` — :func:`run_in_session`, what ``python`` and ``shell``
  call in a session.
- :mod:`stargrpc.sessions.forwarding` — in a fleet: which replica holds a session (Redis),
  and calls for it forwarded there.
- :mod:`stargrpc.sessions.listing` — ListSessions answered for the whole fleet.

The package itself imports none of them: a run names its session's type (``stargrpc.runs``
imports :mod:`.session`), and the registry reaches back into ``stargrpc.runs`` (a forwarded
call's record), so a package that gathered both would close an import loop.
"""
