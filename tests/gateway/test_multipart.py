"""``multipart/form-data`` as ``POST /v1/files`` reads it: what httpx (the ``openai`` client's
transport) encodes parses back to the same fields, and malformed bodies are a ``FormError``."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.gateway._multipart import FormError, boundary_of, parse_form


def encoded(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/v1/files", data=fields, files=files)
    return request.read(), request.headers["content-type"]


def test_the_openai_clients_upload_parses() -> None:
    body, kind = encoded({"purpose": "batch"}, {"file": ("in.jsonl", b'{"a": 1}\n')})
    parts = parse_form(body, kind)
    assert parts["purpose"].data == b"batch"
    assert parts["purpose"].filename is None
    assert parts["file"].filename == "in.jsonl"
    assert parts["file"].data == b'{"a": 1}\n'


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    purpose=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20),
    data=st.binary(max_size=2000),
    filename=st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"], exclude_characters='"'),
        min_size=1,
        max_size=30,
    ),
)
def test_any_file_round_trips(purpose: str, data: bytes, filename: str) -> None:
    body, kind = encoded({"purpose": purpose}, {"file": (filename, data)})
    parts = parse_form(body, kind)
    assert parts["purpose"].data == purpose.encode()
    assert parts["file"].data == data
    assert parts["file"].filename == filename


def test_a_file_that_holds_the_boundarys_prefix_still_parses() -> None:
    kind = "multipart/form-data; boundary=abc"
    body = (
        b"preamble\r\n--abc\r\n"
        b'Content-Disposition: form-data; name="file"; filename="a;b.jsonl"\r\n\r\n'
        b"--ab\r\n-abc\r\n\r\n--ab"  # only CRLF "--abc" ends a part
        b"\r\n--abc--\r\n"
    )
    part = parse_form(body, kind)["file"]
    assert part.filename == "a;b.jsonl"
    assert part.data == b"--ab\r\n-abc\r\n\r\n--ab"


def test_rfc5987_filename() -> None:
    kind = 'multipart/form-data; boundary="q r"'
    body = (
        b"--q r\r\nContent-Disposition: form-data; name=file; "
        b"filename*=UTF-8''na%C3%AFve.jsonl\r\n\r\nx\r\n--q r--"
    )
    assert parse_form(body, kind)["file"].filename == "naïve.jsonl"


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("application/json", b"{}", "multipart/form-data"),
        ("multipart/form-data", b"", "boundary"),
        ("multipart/form-data; boundary=" + "b" * 71, b"", "boundary"),
        ("multipart/form-data; boundary=b", b"no boundary here", "no multipart boundary"),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data", "do not end"),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="f"\r\n\r\ndata',
            "closing boundary",
        ),
        ("multipart/form-data; boundary=b", b"--b\r\nX-A: 1\r\n\r\nd\r\n--b--", "Disposition"),
        ("multipart/form-data; boundary=b", b"--b\r\nnocolon\r\n\r\nd\r\n--b--", "colon"),
        ("multipart/form-data; boundary=b", b"--bxx\r\n\r\nd\r\n--b--", "end its line"),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="f\r\n\r\nd\r\n--b--',
            "quoted",
        ),
        (
            "multipart/form-data; boundary=b",
            b"".join(
                b'--b\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nd\r\n' % i
                for i in range(17)
            )
            + b"--b--",
            "at most 16 parts",
        ),
    ],
)
def test_malformed_forms_are_refused(kind: str, body: bytes, message: str) -> None:
    with pytest.raises(FormError, match=message):
        parse_form(body, kind)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(body=st.binary(max_size=300), boundary=st.sampled_from(["b", "xyz", "--"]))
def test_no_body_raises_anything_but_a_form_error(body: bytes, boundary: str) -> None:
    with contextlib.suppress(FormError):
        parse_form(body, f"multipart/form-data; boundary={boundary}")


def test_boundary_of_reads_quoted_parameters() -> None:
    assert boundary_of('multipart/form-data; charset=utf-8; boundary="a b"') == b"a b"
