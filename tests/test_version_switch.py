"""Session snapshots for a hot model-version switch: the stores (round trip, bounds, whole files only, corrupt
files), the emulated engine loading a moved session's context from them, through the real `openai` client and
Prism's router, and the switch under load (bench/version_switch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from prismlb.otel import DirectorySnapshotStore, MemorySnapshotStore, SessionSnapshot, SnapshotStore, context_hash
from prismlb.router import CONTEXT_HEADER, SESSION_HEADER, PrismTransport, Router
from prismlb.sim import EmulatedEngine
from prismlb.sim._engine import BLOCK_SIZE_TOKENS, MODEL_NAME
from prismlb.wire import Experiment, ExperimentArm, RoutingTable, SliceTable, TableNode

from .conftest import Clock, load_bench, wait_for

UNIX_NOW_S = 1_800_000_000.0
"""Where the stores' fake clock starts: their clock is a wall clock (file times are set from it)."""


def snapshot(session: str, at: float, blocks: int = 4, offset: int = 100) -> SessionSnapshot:
    ids = tuple(hash((session, offset, i)) & (2**63 - 1) for i in range(blocks))
    return SessionSnapshot(
        session=session,
        context_hash=context_hash(session, ids, offset),
        last_active_unix_s=at,
        token_offset=offset,
        blocks=ids,
        model_version="v1",
        engine="http://127.0.0.1:1",
    )


@pytest.fixture(params=["memory", "directory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SnapshotStore:
    if request.param == "memory":
        return MemorySnapshotStore()
    return DirectorySnapshotStore(tmp_path / "snapshots")


def test_a_snapshot_round_trips_and_a_later_one_replaces_it(store: SnapshotStore) -> None:
    now = time.time()
    first, later = snapshot("user-1", now, offset=100), snapshot("user-1", now, blocks=9, offset=260)
    assert store.save(first) and store.save(snapshot("user-2", now))
    assert store.load("user-1") == first
    assert store.save(later)
    assert store.load("user-1") == later and store.load("user-2") is not None
    assert store.load("nobody") is None
    assert len(store) == 2 and store.rejects.total == 0


def test_another_process_view_of_the_directory_reads_the_same_snapshots(tmp_path: Path) -> None:
    writer, reader = DirectorySnapshotStore(tmp_path), DirectorySnapshotStore(tmp_path)
    saved = snapshot("a session id with / and unicode: ü", time.time())
    assert writer.save(saved)
    assert reader.load(saved.session) == saved
    assert [p.name for p in tmp_path.iterdir()] == [writer.file_of(saved.session).name]


def test_the_memory_store_evicts_the_least_recently_saved_and_the_expired() -> None:
    clock = Clock(UNIX_NOW_S)
    store = MemorySnapshotStore(max_sessions=3, max_age_s=60.0, clock=clock)
    for name in "abc":
        store.save(snapshot(name, clock.now))
    store.save(snapshot("a", clock.now))  # saved again: now the most recent
    store.save(snapshot("d", clock.now))
    assert [s for s in "abcd" if store.load(s) is not None] == ["a", "c", "d"] and store.evicted == 1
    clock.now += 61.0
    assert store.load("c") is None and store.evicted == 2


def test_a_sweep_removes_old_files_then_the_least_recently_written_past_the_bound(tmp_path: Path) -> None:
    clock = Clock(UNIX_NOW_S)
    store = DirectorySnapshotStore(tmp_path, max_sessions=5, max_age_s=600.0, sweep_every=1000, clock=clock)
    names = [f"s{i}" for i in range(8)]
    for age, name in zip(range(len(names), 0, -1), names, strict=True):  # s0 the oldest
        assert store.save(snapshot(name, clock.now - age))
        written_ns = int((clock.now - age) * 1e9)
        os.utime(store.file_of(name), ns=(written_ns, written_ns))
    orphan = tmp_path / ".left-by-a-crashed-writer.tmp"
    orphan.write_bytes(b"{")
    os.utime(orphan, (clock.now - 3600, clock.now - 3600))
    assert store.sweep() == 4  # the orphan, then the three oldest of eight for a bound of five
    assert [n for n in names if store.load(n) is not None] == names[3:] and not orphan.exists()
    assert store.evicted == 4 and len(store) == 5
    clock.now += 600.0
    assert all(store.load(n) is None for n in names[3:]), "older than max_age_s: gone before any sweep"
    assert store.sweep() == 5 and len(store) == 0


def test_saves_start_a_sweep_in_the_background(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path, max_sessions=3, sweep_every=5)
    for i in range(4):
        store.save(snapshot(f"s{i}", time.time()))
    assert len(store) == 4  # no sweep before the fifth save
    store.save(snapshot("s4", time.time()))
    wait_for(lambda: store.evicted == 2, what="the background sweep")
    assert len(store) == 3


WRITER = """
import sys, time
from prismlb.otel import DirectorySnapshotStore, SessionSnapshot
store = DirectorySnapshotStore(sys.argv[1])
versions = [
    SessionSnapshot(session="s", context_hash=f"v{v}", last_active_unix_s=time.time(), token_offset=v,
                    blocks=tuple(range(v, v + 60_000)))
    for v in range(2)
]
for i in range(int(sys.argv[2])):
    assert store.save(versions[i % 2])
"""


def test_a_reader_never_sees_a_half_written_snapshot(tmp_path: Path) -> None:
    """Another process rewrites one session's snapshot (about 350 kB each) while this one reads it: each read is
    the whole of one version, none is counted corrupt."""
    reader = DirectorySnapshotStore(tmp_path)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "150"])
    seen: dict[str, int] = {}
    try:
        while writer.poll() is None:
            loaded = reader.load("s")
            if loaded is not None:
                assert loaded.blocks == tuple(range(loaded.token_offset, loaded.token_offset + 60_000))
                seen[loaded.context_hash] = seen.get(loaded.context_hash, 0) + 1
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert sum(seen.values()) >= 5, f"too few reads overlapped the writes: {seen}"
    assert reader.rejects.total == 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary file is left behind"


def test_corrupt_files_and_bad_ids_are_counted_and_skipped(tmp_path: Path) -> None:
    store = DirectorySnapshotStore(tmp_path / "s", max_snapshot_bytes=4096)
    path = store.file_of("s")
    good = snapshot("s", time.time())
    for content in (
        b"{half a snapsh",
        b'{"session": "s"}',
        msgspec.json.encode(good).replace(b'"token_offset":100', b'"token_offset":-1'),
        msgspec.json.encode(good).replace(b'"session":"s"', b'"session":"someone else"'),
        b" " * 5000,
    ):
        path.write_bytes(content)
        assert store.load("s") is None
    assert store.rejects.counts() == {"corrupt": 5}
    assert store.save(good) and store.load("s") == good, "a save replaces a corrupt file"
    assert not store.save(snapshot("x" * 2000, time.time())) and store.load("") is None
    assert store.rejects.counts() == {"corrupt": 5, "session": 2}
    path.unlink()
    store.path.rmdir()
    store.path.write_bytes(b"")  # the directory is gone, a file in its place
    assert not store.save(good) and store.rejects.counts()["write"] == 1


# --- the emulated engine ------------------------------------------------------------------------------------


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[EmulatedEngine, EmulatedEngine, EmulatedEngine]]:
    """A v1 and a v2 engine sharing a snapshot directory, and a v2 engine without snapshots (time 10x faster)."""
    store = tmp_path / "snapshots"
    with (
        EmulatedEngine("h100", time_scale=0.1, model_version="v1", snapshots=DirectorySnapshotStore(store)) as v1,
        EmulatedEngine("h100", time_scale=0.1, model_version="v2", snapshots=DirectorySnapshotStore(store)) as v2,
        EmulatedEngine("h100", time_scale=0.1, model_version="v2") as bare,
    ):
        yield v1, v2, bare


def chat(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=10)


def turn(history: list[ChatCompletionMessageParam], number: int) -> list[ChatCompletionMessageParam]:
    question: ChatCompletionMessageParam = {"role": "user", "content": f"question {number}: " + "more context " * 40}
    return [*history, question]


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def outcome(url: str, name: str) -> float:
    return samples(url)[("prism_engine_context_requests_total", (("outcome", name),))]


def test_a_moved_session_loads_its_context_and_recomputes_it_without_the_store(
    engines: tuple[EmulatedEngine, EmulatedEngine, EmulatedEngine],
) -> None:
    v1, v2, bare = engines
    first = turn([{"role": "system", "content": "a long document " * 300}], 0)
    raw = chat(v1.url).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=first, max_tokens=4, extra_headers={SESSION_HEADER: "user-7"}
    )
    answer = raw.parse()
    assert raw.headers["X-Emulated-Model-Version"] == "v1" and answer.usage is not None
    signature = raw.headers[CONTEXT_HEADER]
    context_tokens = answer.usage.prompt_tokens // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert answer.usage.prompt_tokens_details is not None and answer.usage.prompt_tokens_details.cached_tokens == 0
    second = turn([*first, {"role": "assistant", "content": "tok " * 4}], 1)
    moved = {SESSION_HEADER: "user-7", CONTEXT_HEADER: signature}
    for engine, cached in ((v2, context_tokens), (bare, 0)):
        usage = (
            chat(engine.url)
            .chat.completions.create(model=MODEL_NAME, messages=second, max_tokens=4, extra_headers=moved)
            .usage
        )
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == cached, engine.url
    assert outcome(v2.url, "loaded") == 1
    assert samples(v2.url)[("prism_engine_context_load_seconds_count", ())] == 1
    assert samples(v1.url)[("prism_engine_snapshot_write_seconds_count", ())] == 1
    assert ("prism_engine_context_requests_total", (("outcome", "loaded"),)) not in samples(bare.url)
    # Back on v1, whose own snapshot v2's has replaced: a prompt that does not continue it loads nothing.
    other: list[ChatCompletionMessageParam] = [{"role": "user", "content": "an unrelated conversation " * 40}]
    usage = chat(v1.url).chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=4, extra_headers=moved)
    assert usage.usage is not None and usage.usage.prompt_tokens_details is not None
    assert usage.usage.prompt_tokens_details.cached_tokens == 0 and outcome(v1.url, "stale") == 1


def table(v1: EmulatedEngine, v2: EmulatedEngine, arms: dict[str, float], version: int) -> RoutingTable:
    nodes = [
        TableNode(
            node_id=f"node-{e.model_version}",
            endpoint=e.url.removeprefix("http://"),
            weight=1.0,
            model_version=e.model_version,
        )
        for e in (v1, v2)
    ]
    arm_list = [ExperimentArm(model_version=v, fraction=f) for v, f in arms.items()]
    return RoutingTable(
        epoch=1,
        version=version,
        issued_unix_s=time.time(),
        slices=[SliceTable(name="llm", nodes=nodes)],
        experiments=[Experiment(name="switch", slice="llm", arms=arm_list)],
    )


def test_a_session_the_arm_switch_moves_loads_its_latest_context_on_the_new_version(
    engines: tuple[EmulatedEngine, EmulatedEngine, EmulatedEngine],
) -> None:
    """Through the router: the caller sends back the signature of its first answer only; after the switch the
    router carries it to v2, which loads the session's latest snapshot (its second turn's context)."""
    v1, v2, _ = engines
    router = Router.from_table(table(v1, v2, {"v1": 1.0}, 1))
    http = httpx.Client(transport=PrismTransport(router))
    ai = openai.OpenAI(base_url="http://prism.invalid/v1", api_key="-", http_client=http, max_retries=0, timeout=10)
    history = turn([{"role": "system", "content": "the session's own document " * 200}], 0)
    raw = ai.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=history, max_tokens=4, extra_headers={SESSION_HEADER: "user-9"}
    )
    assert raw.headers["X-Emulated-Model-Version"] == "v1"
    signed = {SESSION_HEADER: "user-9", CONTEXT_HEADER: raw.headers[CONTEXT_HEADER]}
    history = turn([*history, {"role": "assistant", "content": "tok " * 4}], 1)
    second = ai.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4, extra_headers=signed)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0 and outcome(v1.url, "own") == 1
    context_tokens = second.usage.prompt_tokens // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert router.apply(table(v1, v2, {"v2": 1.0}, 2))
    history = turn([*history, {"role": "assistant", "content": "tok " * 4}], 2)
    stream = ai.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        max_tokens=4,
        stream=True,
        extra_headers={SESSION_HEADER: "user-9"},  # no signature: the router adds the session's last
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == context_tokens
    assert outcome(v2.url, "loaded") == 1
    http.close()


# --- the switch under load ----------------------------------------------------------------------------------


def test_a_quick_switch_under_load_loses_no_request() -> None:
    bench = load_bench("version_switch")
    lines: list[str] = []
    (run,) = bench.main(["--quick", "--variant", "snapshots"], out=lines.append)
    assert run.problem is None, run.problem
    report = "\n".join(lines)
    assert not run.lost and not run.broken, report
    moved = run.moved()
    assert moved and all(t.cached_tokens > 0 for t in moved), report
    assert run.outcomes["loaded"] == len(moved), report
    answered = [t for t in run.turns if t.error is None]
    assert run.writes[-1][1] == len(answered), "a snapshot after every answer"
    assert run.store_errors == {} and run.write_failures == 0
