"""``multipart/form-data`` (RFC 7578) read from a whole body: what ``POST /v1/files`` gets.

::

    parts = parse_form(body, headers_content_type)     # {"purpose": Part, "file": Part}
    parts["file"].filename, parts["file"].data

Pure and bounded: at most ``max_parts`` parts, each with at most :data:`MAX_PART_HEAD` bytes
of headers. A part's body is a slice of the request body between two delimiters::

    --B\\r\\n  headers \\r\\n\\r\\n  data  \\r\\n--B\\r\\n  headers \\r\\n\\r\\n  data  \\r\\n--B--
    ▲ opening        (the part's head)   ▲ one part    ▲ each delimiter is CRLF "--" boundary

Anything malformed is a :class:`FormError` (a ``ValueError``: the caller's 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

MAX_PART_HEAD: Final = 8 * 1024
MAX_PARTS: Final = 16


class FormError(ValueError):
    """The body is not the ``multipart/form-data`` it says it is."""


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None
    content_type: str | None
    data: bytes


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data; boundary=…`` content type."""
    kind, params = _header_value(content_type)
    if kind.lower() != "multipart/form-data":
        raise FormError("the body must be multipart/form-data")
    boundary = params.get("boundary")
    if not boundary or len(boundary) > 70:
        raise FormError("multipart/form-data needs a boundary of 1 to 70 characters")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        raise FormError("the multipart boundary must be ASCII") from None


def parse_form(body: bytes, content_type: str, *, max_parts: int = MAX_PARTS) -> dict[str, Part]:
    """The form's parts by name (a name given twice: the first part)."""
    dash = b"--" + boundary_of(content_type)
    delimiter = b"\r\n" + dash
    if body.startswith(dash):
        pos = len(dash)
    else:  # a preamble before the first delimiter is allowed, and ignored
        found = body.find(delimiter)
        if found < 0:
            raise FormError("the body has no multipart boundary")
        pos = found + len(delimiter)
    parts: dict[str, Part] = {}
    count = 0
    while not body.startswith(b"--", pos):  # "--" after a delimiter closes the form
        count += 1
        if count > max_parts:
            raise FormError(f"a form has at most {max_parts} parts")
        end_of_line = body.find(b"\r\n", pos)
        if end_of_line < 0 or body[pos:end_of_line].strip(b" \t"):
            raise FormError("a multipart delimiter must end its line")
        head_start = end_of_line + 2
        if body.startswith(b"\r\n", head_start):  # a part without headers
            head_end = head_start
        else:
            head_end = body.find(b"\r\n\r\n", head_start)
            if head_end < 0:
                raise FormError("a multipart part's headers do not end")
        if head_end - head_start > MAX_PART_HEAD:
            raise FormError(f"a multipart part's headers are over {MAX_PART_HEAD} bytes")
        data_start = head_end + (2 if head_end == head_start else 4)
        data_end = body.find(delimiter, data_start)
        if data_end < 0:
            raise FormError("the form does not end (no closing boundary)")
        part = _part(body[head_start:head_end], body[data_start:data_end])
        parts.setdefault(part.name, part)
        pos = data_end + len(delimiter)
    return parts


def _part(head: bytes, data: bytes) -> Part:
    disposition = None
    content_type = None
    for raw in head.split(b"\r\n") if head else ():
        field, colon, value = raw.partition(b":")
        if not colon:
            raise FormError("a multipart header line has no colon")
        text = value.decode("utf-8", "replace").strip()
        key = field.strip().lower()
        if key == b"content-disposition":
            disposition = text
        elif key == b"content-type":
            content_type = text
    if disposition is None:
        raise FormError("a multipart part has no Content-Disposition")
    kind, params = _header_value(disposition)
    name = params.get("name")
    if kind.lower() != "form-data" or name is None:
        raise FormError("a multipart part must be form-data with a name")
    filename = params.get("filename*")
    if filename is not None:  # RFC 5987: charset'language'percent-encoded
        charset, _, rest = filename.partition("'")
        _, _, encoded = rest.partition("'")
        try:
            filename = unquote(encoded, encoding=charset or "utf-8", errors="strict")
        except (LookupError, UnicodeDecodeError):
            raise FormError("a multipart filename* is not in its charset") from None
    else:
        filename = params.get("filename")
    return Part(name, filename, content_type, data)


def _header_value(value: str) -> tuple[str, dict[str, str]]:
    """``kind; a=1; b="x;y"`` as ``("kind", {"a": "1", "b": "x;y"})`` (keys lowercased)."""
    kind, _, rest = value.partition(";")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while i < n:
        while i < n and rest[i] in " \t;":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq].strip().lower()
        i = eq + 1
        if i < n and rest[i] == '"':
            chars: list[str] = []
            i += 1
            while i < n and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(rest[i])
                i += 1
            if i >= n:
                raise FormError("a quoted header parameter does not end")
            i += 1
            found = "".join(chars)
        else:
            semi = rest.find(";", i)
            semi = n if semi < 0 else semi
            found = rest[i:semi].strip()
            i = semi
        params.setdefault(key, found)
    return kind.strip(), params
