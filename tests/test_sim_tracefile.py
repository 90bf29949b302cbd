"""Trace files (`prism eval --trace`): Mooncake's format (fields, media costs, errors by line), the CSV formats of
Azure's and BurstGPT's traces, the shared traces through the same loader, and an eval run on a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prismlb.cli import main
from prismlb.sim import SimRequest, azure, mooncake_conversation, traces_dir
from prismlb.sim._eval import MM_CLUSTER, TEXT_CLUSTER, cluster_for
from prismlb.sim._tracefile import TraceFormatError, load_trace
from prismlb.sim._workload import AUDIO_TOKENS_PER_CLIP, BLOCK_TOKENS, IMAGE_TOKENS_MAX, audio_tokens

_MOONCAKE = traces_dir() / "mooncake" / "conversation_trace.jsonl"
_AZURE_CODE = traces_dir() / "azure" / "AzureLLMInferenceTrace_code.csv"

_GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}


def _write(path: Path, *rows: dict[str, object] | str) -> Path:
    """A trace file with one line per row: dicts as JSON, strings as written."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_sessions_and_every_modality_load_with_their_media_costs(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mixed.jsonl",
        {**_GOOD, "timestamp": 2000, "session_id": "chat-1"},
        {
            "timestamp": 1000,
            "input_length": 600,
            "output_length": 0,
            "hash_ids": [0, 2],
            "session_id": 7,
            "modality": "image+text",
            "image_tokens": 3000,
        },
        {"timestamp": 1500, "input_length": 0, "output_length": 5, "hash_ids": [], "modality": "audio+text"}
        | {"audio_ms": 45_000},
        "",
        {"timestamp": 3000, "input_length": 512, "output_length": 9, "hash_ids": [3], "modality": "video+text"}
        | {"image_tokens": 4800},
        {**_GOOD, "timestamp": 3000, "input_length": 700, "modality": "rag+text", "notes": "ignored"},
        {**_GOOD, "timestamp": 2500.0, "modality": None, "session_id": None, "audio_ms": None},
    )
    w = load_trace(path)
    assert w.name == "mixed" and w.block_tokens == BLOCK_TOKENS
    assert [r.id for r in w.requests] == list(range(6))
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]  # sorted, from the first arrival
    image, audio, text, untagged, video, rag = w.requests
    assert image == SimRequest(0, 0.0, 600 + 3000, 1, (0, 2), "image+text", {"image": 3}, 3000, "7")
    assert audio == SimRequest(1, 0.5, 1 + 2250, 5, (), "audio+text", {"audio": 2}, 2250, None)
    assert text == SimRequest(2, 1.0, 1000, 20, (0, 1), "text", {}, 0, "chat-1")
    assert untagged == SimRequest(3, 1.5, 1000, 20, (0, 1), "text", {}, 0, None)
    assert video == SimRequest(4, 2.0, 512 + 4800, 9, (3,), "video+text", {"video": 1}, 4800, None)
    assert rag == SimRequest(5, 2.0, 700, 20, (0, 1), "rag+text", {}, 0, None)


def test_media_costs_follow_the_servegen_constants(tmp_path: Path) -> None:
    assert audio_tokens(30_000) == AUDIO_TOKENS_PER_CLIP and audio_tokens(1_000) == 50 and audio_tokens(1) == 1
    rows = [
        {**_GOOD, "modality": "image+text", "image_tokens": IMAGE_TOKENS_MAX},
        {**_GOOD, "modality": "image+text", "image_tokens": IMAGE_TOKENS_MAX + 1},
        {**_GOOD, "modality": "audio+text", "audio_ms": 30_000},
        {**_GOOD, "modality": "audio+text", "audio_ms": 30_000.5},
    ]
    w = load_trace(_write(tmp_path / "media.jsonl", *rows))
    assert [(r.media, r.media_tokens) for r in w.requests] == [
        ({"image": 1}, IMAGE_TOKENS_MAX),
        ({"image": 2}, IMAGE_TOKENS_MAX + 1),
        ({"audio": 1}, AUDIO_TOKENS_PER_CLIP),
        ({"audio": 2}, AUDIO_TOKENS_PER_CLIP),
    ]


def test_limit_takes_the_first_requests_of_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", {**_GOOD, "timestamp": 9000}, "", {**_GOOD, "timestamp": 5000}, {**_GOOD})
    assert [r.arrival_s for r in load_trace(path, limit=2).requests] == [0.0, 4.0]
    assert load_trace(path, limit=0).requests == []


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "JSON is malformed"),
        ("[1, 2]", "Expected `object`, got `array`"),
        ({k: v for k, v in _GOOD.items() if k != "timestamp"}, "missing required field `timestamp`"),
        ({**_GOOD, "timestamp": None}, "Expected `float`, got `null` - at `$.timestamp`"),
        ({**_GOOD, "timestamp": "0"}, "Expected `float`, got `str` - at `$.timestamp`"),
        ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}', "JSON is malformed"),
        ('{"timestamp": 1e999, "input_length": 1, "output_length": 1, "hash_ids": []}', "out of range"),
        ({**_GOOD, "timestamp": -1}, "Expected `float` >= 0.0 - at `$.timestamp`"),
        ({**_GOOD, "input_length": "12"}, "Expected `int`, got `str` - at `$.input_length`"),
        ({**_GOOD, "output_length": 1.5}, "Expected `int`, got `float` - at `$.output_length`"),
        ({**_GOOD, "output_length": True}, "Expected `int`, got `bool` - at `$.output_length`"),
        ({**_GOOD, "input_length": -3}, "Expected `int` >= 0 - at `$.input_length`"),
        ({**_GOOD, "hash_ids": "0,1"}, "Expected `array`, got `str` - at `$.hash_ids`"),
        ({**_GOOD, "hash_ids": [0, -1]}, "Expected `int` >= 0 - at `$.hash_ids[1]`"),
        ({**_GOOD, "hash_ids": [0, True]}, "Expected `int`, got `bool` - at `$.hash_ids[1]`"),
        ({**_GOOD, "input_length": 100}, "hash_ids has 2 ids but input_length 100 fills only 1 blocks"),
        ({**_GOOD, "hash_ids": [9, 1]}, "hash_ids[1] = 1 comes after id 9 here but after id 0 on line 1"),
        ({**_GOOD, "hash_ids": [1]}, "hash_ids[0] = 1 comes after nothing (first block) here"),
        ({**_GOOD, "hash_ids": [7, 7]}, "hash_ids[1] = 7 repeats an id of the same request"),
        ({**_GOOD, "modality": "audio"}, "modality 'audio' is not one of text, image+text"),
        ({**_GOOD, "modality": "image+text"}, "image+text requests need image_tokens"),
        ({**_GOOD, "modality": "video+text", "image_tokens": 0}, "Expected `int` >= 1 - at `$.image_tokens`"),
        ({**_GOOD, "modality": "audio+text"}, "audio+text requests need audio_ms"),
        ({**_GOOD, "modality": "audio+text", "audio_ms": 0}, "Expected `float` > 0.0 - at `$.audio_ms`"),
        ({**_GOOD, "modality": "audio+text", "audio_ms": -5}, "Expected `float` > 0.0 - at `$.audio_ms`"),
        ({**_GOOD, "image_tokens": 10}, "image_tokens sizes image+text and video+text requests, not text"),
        ({**_GOOD, "modality": "image+text", "image_tokens": 9, "audio_ms": 9}, "audio_ms sizes audio+text"),
        ({**_GOOD, "session_id": ""}, "Expected `str` of length >= 1 - at `$.session_id`"),
        ({**_GOOD, "session_id": True}, "got `bool` - at `$.session_id`"),
        ({**_GOOD, "session_id": ["a"]}, "got `array` - at `$.session_id`"),
    ],
)
def test_a_bad_line_names_the_file_and_its_line_number(
    tmp_path: Path, line: dict[str, object] | str, problem: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", _GOOD, "   ", line, _GOOD)
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert caught.value.line == 3 and caught.value.path == path
    assert str(caught.value).startswith(f"{path}, line 3: ") and problem in str(caught.value)


def test_a_byte_order_mark_before_the_first_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_GOOD).encode() + b"\n")
    assert [r.input_tokens for r in load_trace(path).requests] == [1000]


def test_a_limit_stops_before_a_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _GOOD, "{not json")
    assert len(load_trace(path, limit=1).requests) == 1


@pytest.mark.skipif(not _MOONCAKE.exists(), reason=f"traces not found in {traces_dir()}")
def test_the_shared_mooncake_trace_loads_as_it_did_before_the_loader() -> None:
    with _MOONCAKE.open() as f:
        rows = [json.loads(next(f)) for _ in range(400)]
    before = [
        SimRequest(0, r["timestamp"] / 1000, max(1, r["input_length"]), max(1, r["output_length"]), (*r["hash_ids"],))
        for r in rows
    ]
    before.sort(key=lambda r: r.arrival_s)
    w = mooncake_conversation(limit=400)
    assert w.name == "mooncake" and list(w.requests) == list(load_trace(_MOONCAKE, limit=400).requests)
    assert [(r.id, r.input_tokens, r.output_tokens, r.blocks) for r in w.requests] == [
        (i, r.input_tokens, r.output_tokens, r.blocks) for i, r in enumerate(before)
    ]
    # Each arrival stands within the 3 s its timestamp rounds to (the whole shifted to start at 0 again).
    assert all(abs(s.arrival_s - r.arrival_s) < 3.0 for s, r in zip(w.requests, before, strict=True))
    assert len({s.arrival_s for s in w.requests}) == 400 > 8 * len({r.arrival_s for r in before})


_BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
118,GPT-4,417,276,693,API log
5,ChatGPT,472,18,490,Conversation log

45,ChatGPT,1087,0,1087,Conversation log
"""


def test_a_burstgpt_csv_loads_by_its_header(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(_BURSTGPT)
    w = load_trace(path)
    assert w.name == "burst" and "BurstGPT CSV" in w.source
    # Sorted by arrival from 0 s; a failed request (0 response tokens) still arrives, with one token out.
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in w.requests] == [
        (0.0, 472, 18),
        (40.0, 1087, 1),
        (113.0, 417, 276),
    ]
    blocks = [b for r in w.requests for b in r.blocks]
    assert len(blocks) == len(set(blocks)) and [len(r.blocks) for r in w.requests] == [1, 3, 1]
    assert len(load_trace(path, limit=2).requests) == 2


def test_an_azure_csv_loads_with_its_datetimes(tmp_path: Path) -> None:
    path = tmp_path / "week.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.0087240,2048,13\n"
        "2024-05-10 00:00:01.5087240,0,0\n"
        "2024-05-09 23:59:59.0087240,10,5\n"
        "2024-05-10T02:00:03.0087240+02:00,7,7\n"
    )
    w = load_trace(path)
    assert "Azure LLM inference CSV" in w.source
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in w.requests] == [
        (0.0, 10, 5),
        (1.0, 2048, 13),
        (2.5, 1, 1),
        (4.0, 7, 7),
    ]


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("a,b\n1,2\n", 1, "the header names no known CSV format's columns: Azure LLM inference (TIMESTAMP"),
        ("", 1, "BurstGPT (Timestamp, Request tokens, Response tokens)"),
        (_BURSTGPT + "50,GPT-4,12x,3,15,API log\n", 6, "Request tokens is '12x', not a whole number ≥ 0"),
        (_BURSTGPT + "50,GPT-4,-12,3,15,API log\n", 6, "Request tokens is '-12', not a whole number ≥ 0"),
        (_BURSTGPT + "50,GPT-4,12\n", 6, "Response tokens is None, not a whole number ≥ 0"),
        (_BURSTGPT + "nan,GPT-4,12,3,15,API log\n", 6, "Timestamp is 'nan', not a time as BurstGPT writes it"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-13-01 00:00:00,1,1\n",
            2,
            "TIMESTAMP is '2024-13-01 00:00:00', not a time as Azure LLM inference writes it",
        ),
    ],
)
def test_a_bad_csv_row_names_the_file_and_its_line(tmp_path: Path, text: str, line: int, problem: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert caught.value.line == line and str(caught.value).startswith(f"{path}, line {line}: ")
    assert problem in str(caught.value)


def test_a_csv_from_a_spreadsheet_and_a_byte_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + _BURSTGPT.replace("\n", "\r\n").encode())  # a byte-order mark, CRLF lines
    assert [r.input_tokens for r in load_trace(path).requests] == [472, 1087, 417]
    path.write_bytes(_BURSTGPT.encode() + b"50,GPT-\xff,12,3,15,API log\n")
    with pytest.raises(TraceFormatError, match=r"excel\.csv, line 6: not UTF-8 text"):
        load_trace(path)


@pytest.mark.skipif(not _AZURE_CODE.exists(), reason=f"traces not found in {traces_dir()}")
def test_the_shared_azure_trace_is_read_by_the_same_loader() -> None:
    w = azure("code", 300, seed=1)
    assert w.name == "azure-code" and list(w.requests) == list(load_trace(_AZURE_CODE, limit=300, seed=1).requests)
    with _AZURE_CODE.open() as f:
        first = f.readlines()[1].strip().split(",")
    assert (w.requests[0].input_tokens, w.requests[0].output_tokens) == (int(first[1]), int(first[2]))


def test_the_cluster_is_the_multimodal_one_only_for_media(tmp_path: Path) -> None:
    text = load_trace(_write(tmp_path / "text.jsonl", _GOOD, {**_GOOD, "modality": "rag+text"}))
    mixed = load_trace(_write(tmp_path / "mixed.jsonl", _GOOD, {**_GOOD, "modality": "image+text", "image_tokens": 9}))
    assert cluster_for(Path("text.jsonl"), text) == TEXT_CLUSTER and cluster_for(Path("m.jsonl"), mixed) == MM_CLUSTER


def _tiny(path: Path) -> Path:
    """40 requests over 20 s, two conversations growing their prefix turn by turn."""
    rows = []
    for i in range(40):
        turn, session = divmod(i, 2)
        blocks = [session * 1000 + j for j in range(turn // 4 + 1)]
        rows.append(
            {"timestamp": 500 * i, "input_length": 512 * len(blocks), "output_length": 30, "hash_ids": blocks}
            | {"session_id": f"s{session}"}
        )
    return _write(path, *rows)


def test_eval_replays_a_trace_file_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tiny(tmp_path / "tiny.jsonl")
    argv = ["eval", "--trace", str(path), "--levels", "80%", "--policies", "prism,least-conn", "--jobs", "1"]
    assert main([*argv, "--no-kill", "--no-report", "--no-gray"]) == 0
    printed = capsys.readouterr().out
    assert "## tiny · 80% utilisation" in printed and "| prism |" in printed and "| least-conn |" in printed
    assert "mooncake" not in printed  # a file alone replaces the default traces


def test_eval_replays_a_csv_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(
        _BURSTGPT.splitlines()[0] + "\n" + "".join(f"{i / 2},GPT-4,{300 + 50 * i},40,0,API log\n" for i in range(40))
    )
    argv = ["eval", "--trace", str(path), "--levels", "50%", "--policies", "prism,round-robin", "--jobs", "1"]
    assert main([*argv, "--no-kill", "--no-report", "--no-gray"]) == 0
    printed = capsys.readouterr().out
    assert "## burst · 50% utilisation" in printed and "| round-robin |" in printed


def test_eval_stops_on_a_bad_file_before_any_run(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.jsonl", _GOOD, {**_GOOD, "timestamp": -1})
    with pytest.raises(SystemExit, match=r"bad\.jsonl, line 2: Expected `float` >= 0\.0 - at `\$\.timestamp`"):
        main(["eval", "--trace", str(bad), "--no-report"])
    with pytest.raises(SystemExit, match="two traces named 'tiny'"):
        main(["eval", "--trace", str(_tiny(tmp_path / "tiny.jsonl")), "--trace", str(tmp_path / "tiny.jsonl")])
