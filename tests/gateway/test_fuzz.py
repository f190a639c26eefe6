"""Fuzzing the HTTP API: hypothesis sends random requests over real HTTP to a real gateway
over a real sim replica, with auth off and on (real keys, the admin credential).

Bodies: chat- and completion-like objects, and those of the routes beside them (responses,
embeddings, tokenize, detokenize, rerank, score), with fields of random shapes and types
(huge numbers, unicode, missing fields), tenant settings for the admin API, any JSON value,
arbitrary bytes. Headers: good, bad and garbled keys, deadlines, request and session ids.
Methods and paths: every route with every method, and made-up ones.

Nothing may answer 5xx except the documented upstream ones (502, 503, 504, with an
OpenAI-shaped body), nor drop a connection, and the gateway still serves afterwards.
Derandomized with a bounded number of examples, so CI sees the same requests every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpufleet.store import TenantSettings
from tests.gateway.conftest import MODEL, Running, fleet, serve_gateway, sim_replica
from tests.gateway.tenants import ADMIN, serve_tenant_gateway, tenant_fleet

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
    "/admin/tenants",
    "/admin/tenants/fuzzed",
    "/admin/keys",
    "/admin/keys/0123456789ab",
    "/admin/keys/0123456789ab/rotate",
    "/admin/usage",
    "/admin/audit",
    "/v1/files",
    "/v1/files/file-0123",
    "/v1/files/file-0123/content",
    "/v1/batches",
    "/v1/batches/batch_0123",
    "/v1/batches/batch_0123/cancel",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
small_ints = st.integers(min_value=-2, max_value=24)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool"]) | values,
        "content": st.text(max_size=40)
        | st.lists(
            st.fixed_dictionaries({}, optional={"type": st.just("text") | values, "text": values}),
            max_size=2,
        )
        | values,
        "name": values,
    },
)
completion = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | st.just(MODEL) | values,
        "messages": st.lists(message, min_size=1, max_size=3) | values,
        "prompt": st.text(max_size=40) | st.lists(st.text(max_size=8), max_size=2) | values,
        "max_tokens": small_ints | values,
        "max_completion_tokens": small_ints | values,
        "stream": st.booleans() | values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
        "n": small_ints | values,
        "temperature": values,
        "stop": values,
        "user": values,
        "seed": values,
    },
)
tenant_settings = st.fixed_dictionaries(
    {},
    optional={
        "tenant": st.text(max_size=10) | values,
        "models": st.lists(st.text(max_size=8), max_size=2) | values,
        "rpm": st.integers() | values,
        "tpm": st.integers() | values,
        "concurrency": st.integers() | values,
        "priority": st.sampled_from(["interactive", "batch"]) | values,
        "weight": values,
        "extra": values,
    },
)


def mutated(
    base: st.SearchStrategy[dict[str, object]], fields: dict[str, st.SearchStrategy[object]]
) -> st.SearchStrategy[dict[str, object]]:
    """A valid body with up to two fields replaced (by one of their own odd values or any
    JSON value) and up to one dropped: most requests get far enough to be served."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, object]:
        body = dict(draw(base))
        names = sorted(fields)
        for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
            body[name] = draw(fields[name] | values)
        for name in draw(st.lists(st.sampled_from(sorted(body) or ["model"]), max_size=1)):
            body.pop(name, None)
        return body

    return build()


valid_chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}
            ),
            min_size=1,
            max_size=2,
        ),
        "prompt": st.text(max_size=30),  # (a chat body's, ignored; a completion's prompt)
        "max_tokens": st.integers(1, 8),
    },
    optional={"stream": st.booleans()},
)
served_completions = mutated(
    valid_chat,
    {
        "model": st.just(MODEL.upper()) | st.text(max_size=8),
        "messages": st.lists(message, max_size=3),
        "prompt": st.lists(st.text(max_size=8), max_size=2),
        "max_tokens": st.integers() | st.sampled_from([0, -1, 4096, 10**6]),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}),
        "n": st.integers(-1, 3),
        "temperature": st.floats(allow_nan=True),
        "user": st.text(max_size=8),
        "logprobs": st.booleans(),
    },
)
odd_ints = st.integers() | st.sampled_from([0, -1, 2**31, 2**63, 2**70, 10**400])
odd_floats = st.floats() | st.sampled_from([math.inf, -math.inf, math.nan, 1e308, 2**2000])
odd_names = st.text(max_size=10) | st.sampled_from(["", "\x00", "\ud800", "x" * 200, "a\nb"])
valid_settings = st.fixed_dictionaries(
    {},
    optional={
        "rpm": st.integers(1, 10**4),
        "priority": st.sampled_from(["interactive", "batch"]),
        "weight": st.floats(0.1, 10),
    },
)
admin_bodies = mutated(
    valid_settings,
    {
        "models": st.lists(odd_names | odd_ints, max_size=2) | st.text(max_size=4),
        "rpm": odd_ints | odd_floats | st.booleans(),
        "tpm": odd_ints,
        "concurrency": odd_ints,
        "batch_queue": odd_ints | odd_floats,
        "priority": st.text(max_size=8) | st.none(),
        "weight": odd_floats | odd_ints | st.booleans(),
        "admin": st.booleans(),
    },
)


batch = st.fixed_dictionaries(
    {},
    optional={
        "input_file_id": st.sampled_from(["file-0123"]) | values,
        "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/completions"]) | values,
        "completion_window": st.sampled_from(["24h"]) | values,
        "metadata": st.dictionaries(st.text(max_size=70), values, max_size=17) | values,
    },
)
form = st.tuples(st.text(max_size=8), st.binary(max_size=40)).map(
    lambda p: (
        b"--b\r\nContent-Disposition: form-data; name=%s\r\n\r\n%s\r\n--b--"
        % (p[0].encode(errors="replace"), p[1])
    )
)
bodies = (
    completion.map(lambda b: json.dumps(b).encode())
    | batch.map(lambda b: json.dumps(b).encode())
    | form
    | tenant_settings.map(lambda b: json.dumps(b).encode())
    | values.map(lambda b: json.dumps(b).encode())
    | st.binary(max_size=64)
)
paths = st.sampled_from(ROUTES) | st.text(max_size=24).map(lambda t: "/" + quote(t, safe="/"))
latin1 = st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=40)
"""What HTTP lets a header value hold (control characters are the server's own 400)."""
header_value = latin1.map(lambda t: t.strip(" \t").encode("latin-1"))


def header_sets(user_key: str | None) -> st.SearchStrategy[dict[str, bytes]]:
    auth = [b"Bearer " + ADMIN.encode(), b"Bearer", b"Basic abc", b"Bearer gfk_0123_x"]
    if user_key is not None:
        auth.append(b"Bearer " + user_key.encode())
    return st.fixed_dictionaries(
        {},
        optional={
            "authorization": st.sampled_from(auth) | header_value,
            "content-type": st.sampled_from(
                [b"application/json", b"text/plain", b"multipart/form-data; boundary=b"]
            ),
            "x-request-id": header_value,
            "x-session-id": header_value,
            "x-gpufleet-deadline-ms": st.sampled_from([b"nan", b"inf", b"-1", b"1e309", b"0"])
            | header_value,
        },
    )


requests = st.tuples(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    paths,
    st.dictionaries(
        st.sampled_from(["since", "until", "tenant", "limit", "after", "order", "purpose"]),
        latin1 | st.sampled_from(["\x00", "file-0123", "batch_0123"]),
        max_size=2,
    ),
)


def exchange(
    client: httpx.Client,
    base: str,
    request: tuple[str, str, dict[str, str]],
    headers: dict[str, bytes],
    body: bytes,
) -> None:
    method, path, query = request
    try:
        answer = client.request(
            method,
            base + path,
            params=query,
            headers=headers,
            content=body if method not in ("GET", "HEAD") else None,
        )
    except httpx.TransportError as error:
        pytest.fail(f"{method} {path}: the connection failed: {error!r}")
    status = answer.status_code
    if status < 500:
        return
    assert status in (502, 503, 504), f"{method} {path} {headers} {body!r}: {status} {answer.text}"
    error = answer.json()["error"]
    assert isinstance(error["message"], str)
    assert isinstance(error["type"], str)


def still_serving(gw: Running, key: str | None) -> None:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    assert httpx.get(gw.url + "/health").status_code == 200
    answer = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 2},
        headers=headers,
        timeout=10,
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with sim_replica(seed=7) as url:
        yield url


@pytest.fixture(scope="module")
def open_gateway(replica: str) -> Iterator[Running]:
    with serve_gateway(fleet(), [replica]) as gw:
        yield gw


@pytest.fixture(scope="module")
def auth_gateway(
    replica: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Running, str]]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with serve_tenant_gateway(tmp, tenant_fleet(), [replica]) as gw:
        _, key = gw.store.create_key("fuzz", TenantSettings())
        gw.tenancy.reload()
        yield gw, key


@pytest.fixture(scope="module")
def gateways(
    open_gateway: Running, auth_gateway: tuple[Running, str]
) -> tuple[Running, tuple[Running, str]]:
    return open_gateway, auth_gateway


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def with_key(headers: dict[str, bytes], key: str) -> dict[str, bytes]:
    if headers.get("authorization") == b"Bearer USER":
        return {**headers, "authorization": f"Bearer {key}".encode()}
    return headers


@FUZZ
@given(request=requests, headers=header_sets(None), body=bodies)
def test_any_request_auth_off(
    open_gateway: Running,
    client: httpx.Client,
    request: tuple[str, str, dict[str, str]],
    headers: dict[str, bytes],
    body: bytes,
) -> None:
    exchange(client, open_gateway.url, request, headers, body)


@FUZZ
@given(request=requests, headers=header_sets("USER"), body=bodies)
def test_any_request_auth_on(
    auth_gateway: tuple[Running, str],
    client: httpx.Client,
    request: tuple[str, str, dict[str, str]],
    headers: dict[str, bytes],
    body: bytes,
) -> None:
    gw, key = auth_gateway
    exchange(client, gw.url, request, with_key(headers, key), body)


completion_paths = st.sampled_from(["/v1/chat/completions", "/v1/completions"])


@settings(FUZZ, max_examples=300)
@example(  # found by this test: a completion whose `messages` is not a list was a 500
    target=("/v1/completions", False),
    headers={},
    body={"model": MODEL, "prompt": "x", "messages": True, "max_tokens": 1},
)
@given(
    target=st.tuples(completion_paths, st.booleans()),
    headers=header_sets("USER").filter(lambda h: "authorization" not in h),
    body=completion | served_completions | served_completions,
)
def test_completions(
    gateways: tuple[Running, tuple[Running, str]],
    client: httpx.Client,
    target: tuple[str, bool],
    headers: dict[str, bytes],
    body: dict[str, object],
) -> None:
    """Completion bodies of every shape, auth off or through a key that may use the model."""
    path, auth = target
    open_gateway, auth_gateway = gateways
    gw, key = auth_gateway if auth else (open_gateway, "")
    if auth:
        headers = {**headers, "authorization": f"Bearer {key}".encode()}
    exchange(client, gw.url, ("POST", path, {}), headers, json.dumps(body).encode())


valid_surface = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "input": st.text(max_size=30)
        | st.lists(st.text(max_size=10), min_size=1, max_size=3)
        | st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}
            ),
            min_size=1,
            max_size=2,
        ),
        "prompt": st.text(max_size=30),
        "tokens": st.lists(st.integers(0, 1000), max_size=5),
        "max_output_tokens": st.integers(1, 8),
    },
    optional={"stream": st.booleans(), "instructions": st.text(max_size=20)},
)
served_surface = mutated(
    valid_surface,
    {
        "input": st.lists(st.integers(-1, 2**40), max_size=3)
        | st.lists(st.lists(st.integers(-5, 200_000), max_size=3), max_size=2)
        | st.lists(message | st.text(max_size=6), max_size=3),
        "instructions": values,
        "tokens": st.lists(st.integers(-2, 2**33), max_size=4),
        "encoding_format": st.sampled_from(["float", "base64", "int8"]),
        "dimensions": st.integers(-1, 10**5),
        "max_output_tokens": odd_ints,
        "messages": st.lists(message, max_size=2),
        "stream": st.booleans(),
        "previous_response_id": values,
        "background": values,
        "query": values,
        "documents": values,
    },
)
surface_paths = st.sampled_from(
    ["/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/rerank", "/score"]
)


@settings(FUZZ, max_examples=200)
@given(
    target=st.tuples(surface_paths, st.booleans()),
    body=served_surface | completion,
)
def test_the_other_model_routes(
    gateways: tuple[Running, tuple[Running, str]],
    client: httpx.Client,
    target: tuple[str, bool],
    body: dict[str, object],
) -> None:
    """Issue 19: responses, embeddings, tokenize, detokenize, rerank and score bodies of every
    shape, auth off or on: the same rule (nothing but 502/503/504 may be a 5xx)."""
    path, auth = target
    open_gateway, auth_gateway = gateways
    gw, key = auth_gateway if auth else (open_gateway, "")
    headers = {"authorization": f"Bearer {key}".encode()} if auth else {}
    exchange(client, gw.url, ("POST", path, {}), headers, json.dumps(body).encode())


ADMIN_CALLS = [
    ("GET", "/admin/tenants"),
    ("PUT", "/admin/tenants/fuzzed"),
    ("GET", "/admin/keys"),
    ("POST", "/admin/keys"),
    ("POST", "/admin/keys/0123456789ab/rotate"),
    ("DELETE", "/admin/keys/0123456789ab"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/audit"),
]
admin_requests = st.tuples(
    st.sampled_from(ADMIN_CALLS)
    | st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        st.sampled_from([r for r in ROUTES if r.startswith("/admin")])
        | st.text(max_size=16).map(lambda t: "/admin/" + quote(t, safe="/")),
    ),
    st.dictionaries(st.sampled_from(["since", "until", "tenant", "limit"]), latin1, max_size=3),
).map(lambda t: (t[0][0], t[0][1], t[1]))


@settings(FUZZ, max_examples=250)
@given(request=admin_requests, data=st.data())
def test_admin_api(
    auth_gateway: tuple[Running, str],
    client: httpx.Client,
    request: tuple[str, str, dict[str, str]],
    data: st.DataObject,
) -> None:
    """The admin API with the admin credential: settings of every shape and size, tenant
    names odd and long, queries of any text."""
    gw, _ = auth_gateway
    settings_body = admin_bodies
    if request[:2] == ("POST", "/admin/keys"):
        settings_body = st.builds(
            lambda body, name: {**body, "tenant": name},
            admin_bodies,
            st.sampled_from(["fuzzed", "fuzzed-2"]) | odd_names | values,
        )
    elif request[1].startswith("/admin/tenants/") and data.draw(st.booleans()):
        name = data.draw(odd_names.filter(bool))
        path = "/admin/tenants/" + quote(name, safe="", errors="surrogatepass")
        request = (request[0], path, request[2])
    body = data.draw(settings_body.map(lambda b: json.dumps(b).encode()) | bodies, label="body")
    exchange(client, gw.url, request, {"authorization": f"Bearer {ADMIN}".encode()}, body)


@pytest.mark.parametrize(
    ("path", "body"),
    [  # found by test_admin_api: a 500 (the database refused it), or nonsense stored
        ("/admin/tenants/x", {"rpm": 2**70}),
        ("/admin/tenants/x", {"concurrency": 2**63}),
        ("/admin/tenants/x", {"batch_queue": 0}),
        ("/admin/tenants/x", {"batch_queue": 2**63}),
        ("/admin/tenants/x", {"weight": 2**2000}),
        ("/admin/tenants/x", {"weight": "Infinity"}),
        ("/admin/tenants/x", {"rpm": 1.5}),
        ("/admin/tenants/x", {"models": "abc"}),
        ("/admin/tenants/a%00b", {}),
        ("/admin/keys", {"tenant": "\ud800"}),
        ("/admin/keys", {"tenant": "big", "tpm": 2**63}),
        ("/admin/audit?limit=nan", None),
    ],
)
def test_admin_refuses_what_the_database_cannot_hold(
    auth_gateway: tuple[Running, str], path: str, body: dict[str, object] | None
) -> None:
    gw, _ = auth_gateway
    method = "GET" if body is None else ("POST" if path == "/admin/keys" else "PUT")
    content = None if body is None else json.dumps(body).replace('"Infinity"', "Infinity")
    answer = httpx.request(
        method, gw.url + path, content=content, headers={"authorization": f"Bearer {ADMIN}"}
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_the_gateways_still_serve_after_the_fuzz(
    open_gateway: Running, auth_gateway: tuple[Running, str]
) -> None:
    still_serving(open_gateway, None)
    gw, key = auth_gateway
    still_serving(gw, key)
