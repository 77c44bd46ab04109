"""Text every wire and store takes: a string with a lone surrogate (a JSON ``"\\ud800"``
decoded, a file name's bytes that are not UTF-8 kept by ``surrogateescape``) has no UTF-8
form, so a protobuf string, a log line or a database refuses it — here it is written with
the escape spelt out instead."""

from __future__ import annotations


def as_text(text: str) -> str:
    """``text``, with any lone surrogate written as its escape (``\\udcff``)."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode(errors="backslashreplace").decode()
    return text


def as_name(name: str) -> str:
    """A file name as text: the bytes ``surrogateescape`` kept written as ``\\xNN``, and any
    other lone surrogate as its escape."""
    if name.isascii():
        return name
    try:
        name.encode()
    except UnicodeEncodeError:
        try:
            return name.encode(errors="surrogateescape").decode(errors="backslashreplace")
        except UnicodeEncodeError:
            return name.encode(errors="backslashreplace").decode()
    return name
