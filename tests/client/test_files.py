"""Streamed files put back together: by offset, and only when the chunks make the whole."""

from __future__ import annotations

import hashlib

from stargrpc.client._files import StreamedFiles


def chunks(*pieces: tuple[str, int, bytes]) -> StreamedFiles:
    files = StreamedFiles()
    for file_id, offset, data in pieces:
        files.add(file_id, offset, data)
    return files


def test_chunks_arriving_out_of_order_make_the_file_in_offset_order() -> None:
    files = chunks(("f", 4, b"5678"), ("g", 0, b"other"), ("f", 0, b"1234"), ("f", 8, b"9"))

    assert files.content("f", 9) == b"123456789"
    assert files.content("g", 5) == b"other"


def test_a_file_with_a_gap_an_overlap_or_the_wrong_size_is_not_whole() -> None:
    assert chunks(("f", 0, b"12"), ("f", 4, b"56")).content("f", 6) is None  # 2..4 missing
    assert chunks(("f", 0, b"1234"), ("f", 2, b"34")).content("f", 6) is None  # overlap
    assert chunks(("f", 0, b"1234")).content("f", 5) is None  # the end missing
    assert chunks(("f", 2, b"34")).content("f", 2) is None  # the start missing
    assert chunks().content("f", 3) is None


def test_a_replayed_chunk_counts_once_and_an_empty_file_needs_none() -> None:
    files = chunks(("f", 0, b"ab"), ("f", 2, b"cd"), ("f", 2, b"cd"))

    assert files.content("f", 4) == b"abcd"
    assert StreamedFiles().content("empty", 0) == b""
    assert files and not StreamedFiles()


def test_a_file_whose_bytes_do_not_hash_to_its_sha256_is_not_whole() -> None:

    files = chunks(("f", 0, b"12"), ("f", 2, b"34"))
    digest = hashlib.sha256(b"1234").hexdigest()

    assert files.content("f", 4, digest) == b"1234"
    assert files.content("f", 4, digest.upper()) == b"1234"
    assert chunks(("f", 0, b"12"), ("f", 2, b"35")).content("f", 4, digest) is None
