"""Python source a sandboxed snippet starts with to talk to its state socket by hand (the
state socket tests send frames the stargrpc_state module never would)."""

from __future__ import annotations

#: Defines ``connect()`` (a new conversation), ``exchange(conversation, request)`` (a dict
#: sent as one line; the answer), ``raw(frame)`` (bytes on a fresh conversation; the answer)
#: and ``ask(request)`` (on one shared conversation).
RAW_CLIENT = '''
import array as _array, json as _json, os as _os, socket as _socket

def connect():
    broker = _socket.socket(fileno=_os.dup(int(_os.environ["STARGRPC_STATE_FD"])))
    mine, theirs = _socket.socketpair()
    broker.sendmsg([b"c"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                             _array.array("i", [theirs.fileno()]))])
    theirs.close()
    broker.close()
    mine.settimeout(30)
    return mine

def _read_line(conversation):
    data = b""
    while not data.endswith(b"\\n"):
        chunk = conversation.recv(65536)
        if not chunk:
            break
        data += chunk
    return _json.loads(data) if data else {"closed": True}

def send_raw(conversation, frame):
    try:
        conversation.sendall(frame)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused and closed: the answer waits to be read

def exchange(conversation, request):
    send_raw(conversation, _json.dumps(request).encode() + b"\\n")
    return _read_line(conversation)

def raw(frame):
    conversation = connect()
    send_raw(conversation, frame)
    try:
        return _read_line(conversation)
    finally:
        conversation.close()

_shared = []

def ask(request):
    if not _shared:
        _shared.append(connect())
    return exchange(_shared[0], request)
'''
