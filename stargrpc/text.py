"""Text every wire and store takes: a string with a lone surrogate (a JSON ``"\\ud800"``
decoded, a file name's bytes that are not UTF-8 kept by ``surrogateescape``) has no UTF-8
form, so a protobuf string, a log line or a database refuses it — here it is written with
the escape spelt out instead."""

from __future__ import annotations


def is_text(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (no lone surrogate in it)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def as_text(text: str) -> str:
    """``text``, with any lone surrogate written as its escape (``\\udcff``)."""
    return text if is_text(text) else text.encode(errors="backslashreplace").decode()


def as_name(name: str) -> str:
    """A file name as text: the bytes ``surrogateescape`` kept written as ``\\xNN``, and any
    other lone surrogate as its escape."""
    if is_text(name):
        return name
    try:
        return name.encode(errors="surrogateescape").decode(errors="backslashreplace")
    except UnicodeEncodeError:  # a surrogate surrogateescape never makes
        return as_text(name)
