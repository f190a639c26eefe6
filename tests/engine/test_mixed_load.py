"""L4: concurrent clients mixing embeddings, chats (n = 1 and 2, streaming and not) and
responses against one sim engine: every request succeeds and the replica ends idle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.engine.conftest import Served
from tests.engine.test_server import MODEL, client

CLIENTS = 16
ROUNDS = 3


def _one(sim: Served, worker: int, round_: int) -> tuple[str, int]:
    """One request of the mix; (kind, model requests it made)."""
    api = client(sim)
    text = f"client {worker} round {round_}: " + "the river runs past the mill " * (1 + worker)
    kind = ("embed", "chat", "embed", "stream-n2", "embed-batch", "responses")[
        (worker + round_) % 6
    ]
    if kind == "embed":
        reply = api.embeddings.create(model=MODEL, input=text)
        assert len(reply.data) == 1
        assert len(reply.data[0].embedding) == 4096
        return kind, 1
    if kind == "embed-batch":
        batch = api.embeddings.create(model=MODEL, input=[text, text[::-1], "short"])
        assert [d.index for d in batch.data] == [0, 1, 2]
        return kind, 3
    if kind == "chat":
        chat = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8
        )
        assert chat.choices[0].finish_reason in {"stop", "length"}
        return kind, 1
    if kind == "stream-n2":
        chunks = list(
            api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=6,
                n=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
        assert finished == {0, 1}
        return kind, 2
    response = api.responses.create(model=MODEL, input=text, max_output_tokens=8)
    assert response.output_text
    return kind, 1


def test_sixteen_concurrent_clients_mixing_embeddings_and_chats_all_succeed(sim: Served) -> None:
    def finished() -> float:
        return sum(
            sim.sample("vllm:request_success", "vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort")
        )

    before = finished()
    jobs = [(w, r) for r in range(ROUNDS) for w in range(CLIENTS)]
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        results = list(pool.map(lambda job: _one(sim, *job), jobs))
    kinds = {kind for kind, _ in results}
    assert kinds == {"embed", "embed-batch", "chat", "stream-n2", "responses"}
    assert finished() - before == sum(count for _, count in results)
    aborted = sim.sample(
        "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
    )
    assert aborted == 0
    assert sim.sample("vllm:num_requests_running") == 0
    assert sim.sample("vllm:num_requests_waiting") == 0
