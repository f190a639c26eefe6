"""Issue 19's bar as a user meets it: ``make run``'s command (``gpufleet up`` on the default
fleet, here with ``--auth`` and a port of its own) and the official ``openai`` client: the
Responses API streamed and not, embeddings, chat with ``n = 2`` streamed and not; every
call succeeds and is in the usage ledger with its tokens once the gateway stops."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import sqlalchemy

from gpufleet.config import DEFAULT_FLEET, load_fleet
from gpufleet.store import Store
from gpufleet.store import _schema as schema
from tests.up_process import start_up, stop, wait_ready


def test_the_openai_surface_through_make_runs_fleet(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'gpufleet.db'}"
    env = {**os.environ, "GPUFLEET_HOME": str(home), "GPUFLEET_DB_URL": url}
    store = Store.open(url)
    _, key = store.create_key("surface")
    model = load_fleet(DEFAULT_FLEET).models[0].name
    process, base = start_up(None, tmp_path / "up.out", "--auth", run_dir=tmp_path / "run", env=env)
    sent: dict[str, str] = {}  # request id -> what it was
    try:
        wait_ready(base, timeout=30)
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:

            def rid(name: str) -> dict[str, dict[str, str]]:
                sent[f"{name}-1"] = name
                return {"extra_headers": {"x-request-id": f"{name}-1"}}

            answer = client.responses.create(
                model=model, input="Say hello", max_output_tokens=8, **rid("response")
            )
            assert answer.status in ("completed", "incomplete")  # incomplete: max tokens
            assert answer.output_text
            events = list(
                client.responses.create(
                    model=model,
                    input="Say hello",
                    max_output_tokens=8,
                    stream=True,
                    **rid("response-stream"),
                )
            )
            assert events[-1].type in ("response.completed", "response.incomplete")
            embedded = client.embeddings.create(
                model=model, input=["one", "two"], **rid("embeddings")
            )
            assert len(embedded.data) == 2
            assert len(embedded.data[0].embedding) > 0
            chat = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Say hello"}],
                n=2,
                max_tokens=8,
                **rid("chat-n2"),
            )
            assert sorted(c.index for c in chat.choices) == [0, 1]
            chunks = list(
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Say hello"}],
                    n=2,
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                    **rid("chat-n2-stream"),
                )
            )
            assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1}
            assert chunks[-1].usage is not None
        process.send_signal(signal.SIGTERM)  # a clean stop: the journal reaches the database
        process.wait(timeout=30)
        u = schema.usage.c
        with store.engine.connect() as conn:
            rows = {
                r.request_id: r
                for r in conn.execute(
                    sqlalchemy.select(schema.usage).where(u.request_id.in_(list(sent)))
                )
            }
    finally:
        stop(process)
        store.close()
    assert set(rows) == set(sent), f"not in the ledger: {set(sent) - set(rows)}"
    for request_id, row in rows.items():
        assert row.status == 200, (request_id, row.status)
        assert row.prompt_tokens > 0, request_id
        if sent[request_id] != "embeddings":
            assert row.completion_tokens > 0, request_id
    assert rows["chat-n2-1"].completion_tokens == chat.usage.completion_tokens  # both choices
