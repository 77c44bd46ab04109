"""Redaction of secret-looking keys at any depth, and truncation that says what it cut."""

from __future__ import annotations

import json

from stargrpc.audit.redact import (
    REDACTED,
    RedactionLimits,
    is_secret_key,
    redact,
    redacted_json,
    scrub_text,
)


def test_secret_keys_are_redacted_at_any_depth() -> None:
    arguments = {
        "query": "weather",
        "password": "hunter2",
        "config": {"db": {"hosts": [{"name": "a", "db_pass": "p1"},
                                    {"name": "b", "credentials": {"user": "u"}}]}},
        "headers": {"Authorization": "Bearer abc", "X-Api-Key": "k1", "Cookie": "c=1"},
        "apiKey": "k2", "private_key": "-----BEGIN", "client_secret": "s", "sessionId": "x",
        "refresh_token": "t",
    }

    shown = redact(arguments)

    assert shown["query"] == "weather"
    assert shown["password"] == REDACTED
    assert shown["config"]["db"]["hosts"][0] == {"name": "a", "db_pass": REDACTED}
    assert shown["config"]["db"]["hosts"][1]["credentials"] == REDACTED
    assert shown["headers"] == {"Authorization": REDACTED, "X-Api-Key": REDACTED,
                                "Cookie": REDACTED}
    for key in ("apiKey", "private_key", "client_secret", "sessionId", "refresh_token"):
        assert shown[key] == REDACTED, key
    text = json.dumps(shown)
    for secret in ("hunter2", "p1", "Bearer abc", "k1", "k2", "BEGIN"):
        assert secret not in text
    assert arguments["password"] == "hunter2"  # the caller's value is left alone


def test_ordinary_keys_that_merely_contain_a_fragment_are_kept() -> None:
    for key in ("author", "authors", "passenger", "compass", "bypass_cache", "text"):
        assert not is_secret_key(key), key
    assert redact({"author": "ann", "passenger": 3}) == {"author": "ann", "passenger": 3}


def test_long_values_are_cut_with_the_count_of_what_was_cut() -> None:
    limits = RedactionLimits(max_value_chars=10, max_items=3)

    shown = redact({"text": "x" * 25, "items": list(range(5))}, limits)

    assert shown["text"] == "x" * 10 + "…[+15 chars]"
    assert shown["items"] == [0, 1, 2, "…[+2 items]"]


def test_deep_nesting_is_replaced_by_a_marker() -> None:
    value: dict[str, object] = {"leaf": 1}
    for _ in range(30):
        value = {"inner": value}

    text = json.dumps(redact(value, RedactionLimits(max_depth=5)))

    assert "nested deeper than 5 levels" in text
    assert '"leaf"' not in text


def test_the_whole_text_is_capped() -> None:
    text = redacted_json({"a": "y" * 900, "b": "z" * 900},
                         RedactionLimits(max_value_chars=1000, max_total_chars=100))

    assert text.startswith('{"a":"yyy')
    assert text.endswith("chars]")
    assert len(text) < 130
    cut = int(text.rsplit("+", 1)[1].split(" ")[0])
    assert cut == len(json.dumps({"a": "y" * 900, "b": "z" * 900},
                                 separators=(",", ":"))) - 100


def test_values_that_are_not_json_are_shown_as_text() -> None:
    assert json.loads(redacted_json({"when": object.__new__(type("T", (), {
        "__str__": lambda self: "a T"}))})) == {"when": "a T"}


def test_secret_names_are_matched_as_words_whatever_their_spelling() -> None:
    for key in ("jwt", "pin", "PIN", "pin_code", "passcode", "private_key", "privateKey",
                "dbPass", "dbPassword", "db-password", "DB_PASSWORD", "dbpassword", "apiKey",
                "APIKEY", "api-key", "accessToken", "access_token", "clientSecret",
                "X-Api-Key", "x-auth-token", "HTTPAuthToken", "sshPassphrase", "Set-Cookie",
                "refreshToken", "signingKey", "otp", "sessionId"):
        assert is_secret_key(key), key


def test_harmless_keys_that_contain_a_secret_word_are_kept() -> None:
    harmless = {"keyboard": "us", "pinned": True, "spinner": "dots", "author": "ann",
                "tokenizer": "bpe", "max_tokens": 512, "key": "user.name",
                "idempotency_key": "k-1", "passenger": 2, "compass": "N", "typing": "fast",
                "opinion": "fine", "keynote": "k"}
    assert redact(harmless) == harmless


def test_secrets_written_inside_text_are_redacted() -> None:
    cases = {
        "postgresql://app:pg-SECRET@db.internal:5432/prod":
            "postgresql://app:<redacted>@db.internal:5432/prod",
        "redis://:redis-SECRET@cache:6379/0": "redis://:<redacted>@cache:6379/0",
        "clone https://bob:gh-SECRET@git.example/x.git then build":
            "clone https://bob:<redacted>@git.example/x.git then build",
        "GET https://api.example/v1?token=t-SECRET&api_key=k-SECRET&page=2":
            "GET https://api.example/v1?token=<redacted>&api_key=<redacted>&page=2",
        "url=https://h.example/x?access_token=at-SECRET":
            "url=https://h.example/x?access_token=<redacted>",
        "curl -H 'Authorization: Bearer ey-SECRET.x.y' https://a.example":
            "curl -H 'Authorization: Bearer <redacted>' https://a.example",
        "sent Authorization: Basic dXNlcjpw-SECRET": "sent Authorization: Basic <redacted>",
        "bearer tok-SECRET": "bearer <redacted>",
        "host=db port=5432 password=kv-SECRET dbname=app":
            "host=db port=5432 password=<redacted> dbname=app",
        'config {"apiKey": "json-SECRET", "name": "n"}':
            'config {"apiKey": "<redacted>", "name": "n"}',
        "PGPASSWORD='env-SECRET' psql": "PGPASSWORD='<redacted>' psql",
        "pin: 1234-SECRET, spinner: dots": "pin: <redacted>, spinner: dots",
    }
    for text, shown in cases.items():
        assert scrub_text(text) == shown, text


def test_ordinary_text_is_left_alone() -> None:
    for text in ("meet at 12:30, ratio=3:2", "see https://example.com/a?b=c#d",
                 "key=value; max_tokens=512", "ssh://git@github.com/x.git", "a: b", "plain",
                 "tokenizer=bpe author: ann keyboard=us"):
        assert scrub_text(text) == text, text


def test_secrets_inside_argument_values_are_redacted_before_values_are_cut() -> None:
    shown = redact({"dsn": "x" * 20, "note": "use postgresql://u:pw-SECRET@h/db please",
                    "cmd": ["psql", "host=h password=p-SECRET"],
                    "long": "y" * 990 + " password=cut-SECRET-here"},
                   RedactionLimits(max_value_chars=1000))
    text = json.dumps(shown)

    assert "SECRET" not in text
    assert shown["dsn"] == REDACTED  # "dsn" names a secret
    assert shown["note"] == "use postgresql://u:<redacted>@h/db please"
    assert shown["cmd"] == ["psql", "host=h password=<redacted>"]


def test_the_recorded_text_is_compact_json_of_the_redacted_value() -> None:
    # The record's text is what json.dumps writes for the redacted value, whatever it holds
    # (the encoder is made once and reused, and must write each value as dumps does).
    value = {"name": "caf\u00e9 \u2028", "n": [1, 2.5, None, True, float("nan")],
             "nested": {"deeper": {"list": [[], {}]}}, 7: "key not a string",
             "object": object()}
    redacted = redact(value)
    once = redacted_json(value)
    assert once == json.dumps(redacted, ensure_ascii=False, separators=(",", ":"), default=str)
    assert redacted_json(value) == once  # the same text again: nothing carried over
    assert redacted_json("a plain string") == '"a plain string"'
