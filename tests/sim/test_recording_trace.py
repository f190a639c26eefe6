"""A controller recording read as a trace: the what-if on recorded traffic.

The recordings here are written by the real code path: ``FleetController.record`` (its
``DecisionLog``) fed the events the live gateway gives it, and ``gpufleet simulate --record``.
"""

from __future__ import annotations

import io
import json
import random
from itertools import combinations
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import parse_fleet
from gpufleet.control import (
    Arrived,
    ClientGone,
    Finished,
    FleetController,
    Replicas,
    ReplicaSeen,
)
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState, RouteRequest, text_prefix_hashes
from gpufleet.sim import (
    PREFIX_HASH_TOKENS,
    FleetSimulation,
    PromptBuilder,
    SimOptions,
    SimTenant,
    TraceFormat,
    TraceRequest,
    detect_format,
    load_trace,
)

MODEL = "llama-3.1-8b"
runner = CliRunner()


def fleet_yaml(tmp_path: Path, routing: str, name: str | None = None) -> Path:
    path = tmp_path / f"{name or routing}.yaml"
    path.write_text(f"models:\n  - name: {MODEL}\n    replicas: 3\n    routing: {routing}\n")
    return path


# -- a live-shaped recording: the events the gateway gives the controller -------------------

SYSTEM = "You are a careful assistant who answers in short sentences. " * 30  # 1,800 chars


def live_recording(routing: str = "prefix_aware") -> str:
    """What ``gpufleet up --record`` writes for five requests: two sessions on one system
    prompt, a request answered mid-way (the client left), one shed, one in flight at the end."""
    control = FleetController.of(
        parse_fleet({"models": [{"name": MODEL, "replicas": 2, "routing": routing}]}),
        admission=False,
    )
    out = io.StringIO()
    control.record(out)
    seen = tuple(
        ReplicaSeen(ReplicaId(f"{MODEL}-{i}"), ReplicaState.READY, f"127.0.0.1:{9000 + i}")
        for i in range(2)
    )
    control.handle(99.0, Replicas(MODEL, seen))

    def arrive(t: float, rid: str, text: str, session: str, tenant: str) -> None:
        hashes = text_prefix_hashes(text) if control.pools[MODEL].settings.hashes else ()
        request = RouteRequest(rid, MODEL, hashes, len(text) // 4, session, tenant)
        control.handle(t, Arrived(request))

    first = SYSTEM + "user: what is a KV cache?" + " tell me more." * 40  # 2,385 chars
    arrive(100.0, "r1", first, "s1", "team-a")
    arrive(100.5, "r2", first + " and prefix caching" + " why?" * 200, "s1", "team-a")
    arrive(101.25, "r3", SYSTEM + "user: something else" + "!" * 600, "s2", "team-b")
    control.handle(102.0, Finished(MODEL, "r2", Outcome.SUCCESS, (700, 40)))
    control.handle(102.5, Finished(MODEL, "r1", Outcome.SUCCESS, (2000, 10)))
    control.handle(103.0, Finished(MODEL, "r3", Outcome.CANCELLED, (300, 3)))  # left mid-way
    arrive(104.0, "r4", "short", "s3", "team-b")
    control.handle(104.1, ClientGone(MODEL, "r4"))  # gone before an answer: no output known
    arrive(105.0, "r5", "short again", "s3", "team-b")  # in flight when the recording ends
    return out.getvalue()


def test_a_live_recording_is_a_trace_of_its_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(live_recording())
    assert detect_format(path) is TraceFormat.RECORDING
    reader = load_trace(path)
    requests = list(reader)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.25, 4.0, 5.0]  # from the first
    assert [r.input_tokens for r in requests] == [596, 851, 605, 1, 2]  # chars // 4, ≥ 1
    # answered: the tokens it got (r3 left after 3); no answer: the median of answers, 10
    assert [r.output_tokens for r in requests] == [10, 40, 3, 10, 10]
    assert reader.estimated == 2
    assert [r.session for r in requests] == ["s1", "s1", "s2", "s3", "s3"]
    assert [r.tenant for r in requests] == ["team-a", "team-a", "team-b", "team-b", "team-b"]
    assert {r.model for r in requests} == {MODEL}
    assert {r.block_tokens for r in requests} == {PREFIX_HASH_TOKENS}
    # 512-character blocks: r1 has 4, r2 extends r1's prompt (its 4 and 2 more), r3 shares
    # the system prompt's 3 full blocks (1,536 of its 1,800 characters) only; the short
    # prompts have none
    r1, r2, r3, r4, r5 = (r.hash_ids for r in requests)
    assert r1 == (0, 1, 2, 3)
    assert r2 == (0, 1, 2, 3, 4, 5)
    assert r3 == (0, 1, 2, 6)
    assert r4 is None
    assert r5 is None
    assert any("2 of 5 recorded requests have no output length" in n for n in reader.notes)
    assert any("10 tokens" in n for n in reader.notes)


def test_shared_recorded_blocks_are_shared_prompt_ids(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(live_recording())
    r1, r2, r3, *_ = load_trace(path)
    prompts = PromptBuilder(32_000)
    a, b, c = (prompts.prompt(i, r) for i, r in enumerate((r1, r2, r3)))
    four, three = 4 * PREFIX_HASH_TOKENS, 3 * PREFIX_HASH_TOKENS
    assert a[:four] == b[:four]
    assert a[four : four + 4] != b[four : four + 4]  # r1's own tail, r2's fifth block
    assert a[:three] == c[:three]
    assert a[three : three + 4] != c[three : three + 4]


def test_a_pool_whose_router_did_not_hash_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(live_recording(routing="least_request"))
    reader = load_trace(path)
    assert all(r.hash_ids is None for r in reader)
    assert any(f"pool '{MODEL}' was recorded with least_request routing" in n for n in reader.notes)


# -- a simulated run, recorded, replayed as a trace -------------------------------------------


def multi_turn_trace(tmp_path: Path, rows: int = 80) -> Path:
    """Sessions that grow turn by turn over three system prompts, in 128-token multiples (a
    recording keeps whole 128-token blocks; the rest of a prompt is the request's own)."""
    rng = random.Random(3)
    path = tmp_path / "trace.jsonl"
    turns: dict[int, list[int]] = {}
    t = 0.0
    with path.open("w") as file:
        for i in range(rows):
            session = rng.randrange(8)
            history = turns.setdefault(session, [session % 3])
            history.append(100 + i)
            row = {
                "arrival_s": round(t, 4),
                "input_tokens": 128 * rng.randrange(4 * len(history) - 3, 4 * len(history) + 1),
                "output_tokens": rng.randrange(1, 60),
                "hash_ids": list(history),
                "session": f"s{session}",
                "tenant": "heavy" if session < 5 else "light",
            }
            file.write(json.dumps(row) + "\n")
            t += rng.expovariate(8.0)
    return path


def blocks_of(request: TraceRequest) -> list[tuple[int, int]]:
    """A request's 128-token blocks, named (its hash id, the 128-token part of it)."""
    per = request.block_tokens // PREFIX_HASH_TOKENS
    names = [(h, k) for h in request.hash_ids or () for k in range(per)]
    return names[: request.input_tokens // PREFIX_HASH_TOKENS]


def shared(a: list[object], b: list[object]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_simulated_run_recorded_replays_as_the_same_trace(tmp_path: Path) -> None:
    source = multi_turn_trace(tmp_path)
    fleet = parse_fleet({"models": [{"name": MODEL, "replicas": 3, "routing": "prefix_aware"}]})
    options = SimOptions(seed=4, admission=True, tenants=(SimTenant("heavy"), SimTenant("light")))
    recording = tmp_path / "recording.jsonl"
    original = FleetSimulation(fleet, options)
    with recording.open("w") as out:
        original.control.record(out)
        original.start(load_trace(source))
        original.run()

    trace, replayed = list(load_trace(source)), list(load_trace(recording))
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in replayed] == [
        (r.arrival_s, r.input_tokens, r.output_tokens) for r in trace
    ]
    assert [(r.session, r.tenant) for r in replayed] == [(r.session, r.tenant) for r in trace]
    assert {r.model for r in replayed} == {MODEL}
    # the prefix structure, block by block: every pair shares as many 128-token blocks
    pairs = list(combinations(range(len(trace)), 2))
    original_shared = [shared(blocks_of(trace[i]), blocks_of(trace[j])) for i, j in pairs]
    replayed_shared = [shared(blocks_of(replayed[i]), blocks_of(replayed[j])) for i, j in pairs]
    assert replayed_shared == original_shared
    assert sum(original_shared) > 100  # the sessions do share

    again = FleetSimulation(fleet, options)
    again.start(load_trace(recording))
    again.run()
    first, second = original.report({}), again.report({})
    assert second["overall"]["prefix_hit_rate"] > 0.3
    # the same fleet and seed on the recorded arrivals: every request's row is the same
    assert second["digest"] == first["digest"]


def test_simulate_compares_routers_on_a_recording_end_to_end(tmp_path: Path) -> None:
    source = multi_turn_trace(tmp_path)
    recorded = tmp_path / "live"
    result = runner.invoke(
        app,
        ["simulate", "--trace", str(source), "--fleet", str(fleet_yaml(tmp_path, "prefix_aware")),
         "--record", "--no-plots", "--out", str(recorded)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = tmp_path / "whatif"
    result = runner.invoke(
        app,
        ["simulate", "--trace", str(recorded / "recording.jsonl"), "--compare",
         str(fleet_yaml(tmp_path, "round_robin", "rr")),
         str(fleet_yaml(tmp_path, "prefix_aware", "prefix")), "--no-plots", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    compared = json.loads((out / "compare.json").read_text())
    assert compared["inputs"]["format"] == "recording"
    assert compared["inputs"]["requests"] == 80
    assert compared["inputs"]["estimated_outputs"] == 0
    rr, prefix = (compared["fleets"][n]["overall"] for n in ("rr", "prefix"))
    assert prefix["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    assert prefix["requests"] == rr["requests"] == 80


def test_simulate_prints_what_the_recording_lacks(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(live_recording(routing="round_robin"))
    result = runner.invoke(
        app, ["simulate", "--trace", str(path), "--no-plots", "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    assert "median answer, 10 tokens" in " ".join(result.output.split())
    assert "does not hash prompts" in " ".join(result.output.split())
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["inputs"]["estimated_outputs"] == 2
    assert report["overall"]["requests"] == 5


# -- bad recordings ------------------------------------------------------------------------

HEADER = json.dumps(
    {
        "gpufleet_recording": 1,
        "seed": 0,
        "admission": False,
        "autoscale": True,
        "fleet": {"models": [{"name": MODEL, "routing": "prefix_aware"}]},
    }
)


def arrived(t: object, **event: object) -> str:
    body = {"kind": "arrived", "model": MODEL, "id": "a", "hashes": [5, -3]}
    body.update({"prompt_tokens": 300, "session": None, "tenant": None, "priority": 0})
    return json.dumps({"t": t, "event": {**body, **event}, "commands": []})


FINISHED = json.dumps(
    {"t": 2, "event": {"kind": "finished", "model": MODEL, "id": "a", "outcome": "success",
                       "work": [10, 7]}, "commands": []}
)  # fmt: skip


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([HEADER, arrived(1), '{"t": 2, "event":'], r"rec\.jsonl:3: JSON: Expecting value"),
        ([HEADER, arrived("soon"), FINISHED], r"rec\.jsonl:2: t: 'soon' is not a time"),
        ([HEADER, '{"t": 1, "event": {"id": "a"}}'], r"rec\.jsonl:2: event: expected an object"),
        ([HEADER, arrived(1, id=None), FINISHED], r"rec\.jsonl:2: arrived\.id: missing"),
        ([HEADER, arrived(1, model=7), FINISHED], r"rec\.jsonl:2: arrived\.model: 7 is not a"),
        ([HEADER, arrived(1, hashes="x"), FINISHED], r"rec\.jsonl:2: arrived\.hashes: expected"),
        (
            [HEADER, arrived(1, prompt_tokens=-1), FINISHED],
            r"rec\.jsonl:2: arrived\.prompt_tokens: -1 is not a count",
        ),
        (
            [HEADER, arrived(1), FINISHED.replace("[10, 7]", "[10]")],
            r"rec\.jsonl:3: finished\.work: expected \[uncached prompt tokens, output tokens\]",
        ),
        (
            [HEADER, arrived(1), FINISHED.replace("[10, 7]", "null")],
            r"rec\.jsonl: no request in the recording finished with a known output length "
            r"\(the gateway meters and records it only with tenants\.auth on\)",
        ),
        (
            [HEADER, arrived(3), arrived(1, id="b"), FINISHED],
            r"rec\.jsonl:3: t: 1\.0 s comes before the previous arrival's 3\.0 s; "
            r"the recording is out of order",
        ),
        (
            [HEADER.replace('"gpufleet_recording": 1', '"gpufleet_recording": 9'), arrived(1)],
            r"rec\.jsonl:1: not a gpufleet recording",
        ),
    ],
)
def test_a_bad_line_is_named_by_file_line_and_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message) as error:
        list(load_trace(path, format="recording"))
    assert "\n" not in str(error.value)


def test_simulate_says_which_line_is_bad_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(f"{HEADER}\n{arrived(1)}\n{arrived(2, hashes=[1.5])}\n{FINISHED}\n")
    result = runner.invoke(
        app, ["simulate", "--trace", str(path), "--no-plots", "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 2
    assert "rec.jsonl:3: arrived.hashes: expected a list of integers" in result.output
    assert "Traceback" not in result.output
