"""Trace readers on small files written here; the real traces only where they exist."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gpufleet.sim import ArrivalProcess, TraceFormat, TraceRequest, detect_format, load_trace

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def write(path: Path, text: str, newline: str = "\n") -> Path:
    path.write_bytes(text.replace("\n", newline).encode())
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951690,10,1
2023-11-16 18:16:00.0000001,879,31
"""


def test_azure_2023_seconds_from_the_first_row(tmp_path: Path) -> None:
    trace = write(tmp_path / "conv.csv", AZURE, newline="\r\n")  # the published file is CRLF
    requests = list(load_trace(trace))
    assert [r.arrival_s for r in requests] == [0.0, 4.314579, 4.314579, 13.3194101]
    assert [(r.input_tokens, r.output_tokens) for r in requests][:2] == [(374, 44), (396, 109)]
    assert requests[0] == TraceRequest(0.0, 374, 44)
    assert detect_format(trace) is TraceFormat.AZURE


def test_azure_2024_timezone_and_whole_seconds(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "week.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 23:59:59.5+00:00,10,2\n"
        "2024-05-11 00:00:01+00:00,20,3\n"
        "2024-05-11T02:00:02.25+02:00,30,4\n",
    )
    assert [r.arrival_s for r in load_trace(trace)] == [0.0, 1.5, 2.75]


def test_mooncake(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 300, "output_length": 9, "hash_ids": [0]},
    ]
    trace = write(tmp_path / "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert list(load_trace(trace)) == [
        TraceRequest(0.0, 600, 5, (0, 1)),
        TraceRequest(1.5, 300, 9, (0,)),
    ]
    assert detect_format(trace) is TraceFormat.MOONCAKE


def test_burstgpt_skips_failed_requests(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "burst.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,API log\n",
    )
    reader = load_trace(trace)
    assert list(reader) == [
        TraceRequest(0.0, 472, 18, model="ChatGPT"),
        TraceRequest(113.0, 417, 276, model="GPT-4"),
    ]
    assert (reader.skipped, reader.requests, reader.format) == (1, 2, TraceFormat.BURSTGPT)


def test_gpufleet_jsonl(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        '{"arrival_s": 0.25, "input_tokens": 1000, "output_tokens": 20, "hash_ids": [3, 4],'
        ' "session": "u1", "model": "llama-3.1-8b", "tenant": "team-a"}\n'
        "\n"
        '{"arrival_s": 2, "input_tokens": 8, "output_tokens": 1}\n',
    )
    assert list(load_trace(trace)) == [
        TraceRequest(0.25, 1000, 20, (3, 4), "u1", "llama-3.1-8b", "team-a"),
        TraceRequest(2.0, 8, 1),
    ]
    assert detect_format(trace) is TraceFormat.JSONL


@pytest.mark.parametrize(
    "header",
    ["num_prefill_tokens,num_decode_tokens,num_total_tokens", "input_tokens,output_tokens"],
)
def test_lengths_table_takes_seeded_arrivals(tmp_path: Path, header: str) -> None:
    rows = "".join(f"{100 + i},{10 + i}{',0' if 'num_' in header else ''}\n" for i in range(50))
    trace = write(tmp_path / "lengths.csv", header + "\n" + rows)
    assert detect_format(trace) is TraceFormat.LENGTHS
    first = list(load_trace(trace, arrivals=ArrivalProcess(2.0), rng=random.Random(7)))
    again = list(load_trace(trace, arrivals=ArrivalProcess(2.0), rng=random.Random(7)))
    assert first == again
    assert [(r.input_tokens, r.output_tokens) for r in first] == [
        (100 + i, 10 + i) for i in range(50)
    ]
    times = [r.arrival_s for r in first]
    assert times == sorted(times)
    assert times[0] > 0
    with pytest.raises(ValueError, match="has no timestamps"):
        load_trace(trace)
    with pytest.raises(ValueError, match="seeded rng"):
        load_trace(trace, arrivals=ArrivalProcess(2.0))


def test_arrivals_replace_the_timestamps_of_any_trace(tmp_path: Path) -> None:
    trace = write(tmp_path / "conv.csv", AZURE)
    requests = list(load_trace(trace, arrivals=ArrivalProcess(100.0), rng=random.Random(1)))
    assert [r.input_tokens for r in requests] == [374, 396, 10, 879]
    assert requests[-1].arrival_s < 1.0


def test_rate_scale_and_duration(tmp_path: Path) -> None:
    trace = write(tmp_path / "conv.csv", AZURE)
    fast = [r.arrival_s for r in load_trace(trace, rate_scale=2.0)]
    assert fast == [0.0, 4.314579 / 2, 4.314579 / 2, 13.3194101 / 2]
    assert [r.arrival_s for r in load_trace(trace, duration=4.314579)] == [0.0]
    assert [r.arrival_s for r in load_trace(trace, rate_scale=2.0, duration=3.0)] == fast[:3]
    assert list(load_trace(trace, duration=0.0)) == []
    # synthetic arrivals scale with the rate too
    rng = random.Random(3)
    slow = [r.arrival_s for r in load_trace(trace, arrivals=ArrivalProcess(1.0), rng=rng)]
    rng = random.Random(3)
    scaled = load_trace(trace, rate_scale=4.0, arrivals=ArrivalProcess(1.0), rng=rng)
    assert [r.arrival_s for r in scaled] == pytest.approx([t / 4 for t in slow])
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate_scale"):
            load_trace(trace, rate_scale=bad)
    with pytest.raises(ValueError, match="duration"):
        load_trace(trace, duration=-1)


def test_format_detection_without_a_known_extension(tmp_path: Path) -> None:
    moon = write(tmp_path / "trace", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert detect_format(moon) is TraceFormat.MOONCAKE
    azure = write(tmp_path / "trace.txt", AZURE)
    assert detect_format(azure) is TraceFormat.AZURE
    assert load_trace(azure, format="azure").format is TraceFormat.AZURE


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("x.csv", "a,b,c\n1,2,3\n", r"x\.csv:1: cannot tell the trace format from a, b, c"),
        ("x.jsonl", '{"prompt": 1}\n', r"x\.jsonl:1: cannot tell the trace format from prompt"),
        ("x.csv", "", r"x\.csv:1: cannot tell the trace format from an empty first line"),
    ],
)
def test_unknown_formats(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_trace(write(tmp_path / name, text))


def test_unknown_format_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace format 'sharegpt'; expected one of azure"):
        load_trace(write(tmp_path / "x.csv", AZURE), format="sharegpt")


MALFORMED = [
    (
        "bad.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12x,4\n",
        r"bad\.csv:2: ContextTokens: '12x' is not an integer",
    ),
    (
        "bad.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46,1,4\n2023-13-16 18:00:00,1,1\n",
        r"bad\.csv:3: TIMESTAMP: '2023-13-16 18:00:00' is not a time",
    ),
    (
        "bad.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,0\n",
        r"bad\.csv:2: GeneratedTokens: 0 is below 1",
    ),
    (
        "bad.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1\n",
        r"bad\.csv:2: row: 2 fields, the header has 3",
    ),
    (
        "bad.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46,1,1\n2023-11-16 18:15:45,1,1\n",
        r"bad\.csv:3: timestamp: -1\.000000 s comes before the previous row's 0\.000000 s",
    ),
    (
        "bad.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "soon,ChatGPT,1,1,2,API log\n",
        r"bad\.csv:2: Timestamp: 'soon' is not a number of seconds",
    ),
    (
        "bad.csv",
        "num_prefill_tokens,num_decode_tokens\n5,-3\n",
        r"bad\.csv:2: num_decode_tokens: -3 is below 1",
    ),
    (
        "bad.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n',
        r"bad\.jsonl:2: JSON: Expecting property name",
    ),
    (
        "bad.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2]\n',
        r"bad\.jsonl:2: JSON: expected an object",
    ),
    (
        "bad.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}\n',
        r"bad\.jsonl:1: hash_ids: expected a list of integers >= 0",
    ),
    (
        "bad.jsonl",
        '{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n',
        r"bad\.jsonl:1: input_length: 5\.5 is not an integer",
    ),
    (
        "bad.jsonl",
        '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n'
        '{"arrival_s": 1, "input_tokens": 5}\n',
        r"bad\.jsonl:2: output_tokens: missing",
    ),
    (
        "bad.jsonl",
        '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "ouput_tokens": 1}\n',
        r"bad\.jsonl:1: ouput_tokens: unknown key",
    ),
    (
        "bad.jsonl",
        '{"arrival_s": -1, "input_tokens": 5, "output_tokens": 1}\n',
        r"bad\.jsonl:1: arrival_s: -1 is not a number >= 0",
    ),
    (
        "bad.jsonl",
        '{"arrival_s": 0, "input_tokens": true, "output_tokens": 1}\n',
        r"bad\.jsonl:1: input_tokens: True is not an integer",
    ),
    (
        "bad.jsonl",
        '{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "session": 7}\n',
        r"bad\.jsonl:1: session: 7 is not a string",
    ),
]


@pytest.mark.parametrize(("name", "text", "message"), MALFORMED)
def test_malformed_rows_name_file_line_and_field(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    trace = write(tmp_path / name, text)
    with pytest.raises(ValueError, match=message) as error:
        list(
            load_trace(
                trace,
                arrivals=None if "num_" not in text else ArrivalProcess(1.0),
                rng=random.Random(0),
            )
        )
    assert "\n" not in str(error.value)


def test_readers_stream(tmp_path: Path) -> None:
    """A bad row late in the file does not stop the rows before it from being read."""
    rows = "".join(f"2023-11-16 18:15:{i:02d},10,1\n" for i in range(50))
    trace = write(
        tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows + "x,1,1\n"
    )
    reader = load_trace(trace)
    assert next(reader).arrival_s == 0.0
    assert sum(1 for _ in zip(range(49), reader, strict=False)) == 49
    with pytest.raises(ValueError, match=r"t\.csv:52: TIMESTAMP"):
        next(reader)


# -- the real traces, where they exist (CI has ../shared beside the clone) -------------------


def _shared(path: str) -> Path:
    trace = SHARED_TRACES / path
    if not trace.exists():
        pytest.skip(f"{trace} is not here")
    return trace


def test_real_azure_2023_conversation_trace() -> None:
    reader = load_trace(_shared("azure-llm-2023/AzureLLMInferenceTrace_conv.csv"))
    requests = list(reader)
    assert reader.format is TraceFormat.AZURE
    assert len(requests) == 19_366
    assert 3_500 < requests[-1].arrival_s < 3_600
    assert sum(r.input_tokens for r in requests) / len(requests) == pytest.approx(1155, rel=0.01)


def test_real_mooncake_conversation_trace() -> None:
    requests = list(load_trace(_shared("mooncake-fast25/conversation_trace.jsonl")))
    assert len(requests) == 12_031
    assert all(r.hash_ids and len(r.hash_ids) == -(-r.input_tokens // 512) for r in requests)


def test_real_vidur_length_table() -> None:
    path = _shared("vidur-length-stats/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")
    reader = load_trace(path, arrivals=ArrivalProcess(5.0), rng=random.Random(0), duration=60)
    requests = list(reader)
    assert reader.format is TraceFormat.LENGTHS
    assert 200 < len(requests) < 400  # about 5/s for a minute


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.csv: no such trace file"):
        load_trace(tmp_path / "nope.csv", format="azure")
    binary = tmp_path / "x.csv"
    binary.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe\x00garbage,1,1\n")
    with pytest.raises(ValueError, match=r"x\.csv: not UTF-8 text"):
        list(load_trace(binary))
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"x\.csv: not UTF-8 text"):
        load_trace(binary)
