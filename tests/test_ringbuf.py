"""The ring buffer reader on a real BPF ring buffer: a one-page ring that a small program (through bcc) fills with
13-byte records on our own getppid() calls, discarding every third, so that records are padded, skipped, wrap
around the ring's end and overflow it. Skipped only without root or bcc."""

from __future__ import annotations

import importlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from prismlb.agent._ringbuf import RingReader

from .conftest import require_ebpf

pytestmark = pytest.mark.ebpf

PROGRAM = """
struct record {
    u64 seq;
    u32 check;
    u8 last;
} __attribute__((packed));

BPF_RINGBUF_OUTPUT(records, 1);
BPF_ARRAY(sequence, u64, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != TEST_PID) {
        return 0;
    }
    u32 zero = 0;
    u64 *next = sequence.lookup(&zero);
    if (!next) {
        return 0;
    }
    u64 seq = __sync_fetch_and_add(next, 1);
    struct record *r = records.ringbuf_reserve(sizeof(struct record));
    if (!r) {
        return 0;
    }
    r->seq = seq;
    r->check = (u32)seq * 7 + 1;
    r->last = 0xAB;
    if (seq % 3 == 2) {
        records.ringbuf_discard(r, 0);
    } else {
        records.ringbuf_submit(r, 0);
    }
    return 0;
}
"""
RECORD = struct.Struct("=QIB")
RECORD_SLOT = 24
"""A record's room in the ring: 8 bytes of header and 13 of data, padded to 8."""


def _decode(buffer: mmap.mmap, offset: int) -> int:
    seq, check, last = RECORD.unpack_from(buffer, offset)
    assert (check, last) == ((seq * 7 + 1) & 0xFFFFFFFF, 0xAB), (seq, check, last)
    return int(seq)


def _submitted(first: int, count: int) -> list[int]:
    """The sequence numbers the program submitted (not discarded) among `count` calls from `first` on."""
    return [seq for seq in range(first, first + count) if seq % 3 != 2]


@pytest.fixture
def reader() -> Iterator[RingReader]:
    require_ebpf()
    bcc = importlib.import_module("bcc")
    bpf = bcc.BPF(text=PROGRAM.encode(), cflags=[f"-DTEST_PID={os.getpid()}"])
    records = bpf[b"records"]
    ring = RingReader(records.map_fd, records.max_entries)
    try:
        yield ring
    finally:
        ring.close()
        bpf.cleanup()


def _calls(count: int) -> None:
    for _ in range(count):
        os.getppid()


def test_records_come_whole_in_order_without_the_discarded(reader: RingReader) -> None:
    assert reader.size == mmap.PAGESIZE
    assert not reader.ready() and reader.drain(_decode, 1000) == []
    _calls(30)
    assert reader.ready()
    assert reader.drain(_decode, 1000) == _submitted(0, 30)
    assert not reader.ready()


def test_records_wrap_around_the_end_of_the_ring(reader: RingReader) -> None:
    """Forty rounds of 60 calls (40 records kept, 60 slots used) go through the one page twelve times over, with
    records cut by the ring's end (4096 is no multiple of 24)."""
    taken: list[int] = []
    for _ in range(40):
        _calls(60)
        taken += reader.drain(_decode, 1000)
    assert 40 * 60 * RECORD_SLOT > 12 * reader.size
    assert taken == _submitted(0, 40 * 60)


def test_drain_takes_at_most_its_limit_oldest_first(reader: RingReader) -> None:
    _calls(30)
    expected = _submitted(0, 30)
    assert reader.drain(_decode, 5) == expected[:5]
    assert reader.ready()
    assert reader.drain(_decode, 1000) == expected[5:]


def test_a_full_ring_keeps_its_oldest_records_and_takes_new_ones_once_read(reader: RingReader) -> None:
    capacity = reader.size // RECORD_SLOT
    _calls(3 * capacity)  # two thirds submitted, each also holding its discarded neighbour's slot until taken
    kept = reader.drain(_decode, 10 * capacity)
    assert 0 < len(kept) < len(_submitted(0, 3 * capacity))
    assert kept == _submitted(0, 3 * capacity)[: len(kept)]
    _calls(3)
    assert reader.drain(_decode, 1000) == _submitted(3 * capacity, 3)


def test_wait_returns_once_a_record_is_written(reader: RingReader) -> None:
    """The kernel notifies a reader that has taken everything: `wait` returns well before its timeout."""
    assert not reader.ready()
    caller = threading.Thread(target=_calls, args=(1,))
    started = time.monotonic()
    caller.start()
    reader.wait(30.0)
    caller.join()
    assert time.monotonic() - started < 30.0
    assert reader.ready() and reader.drain(_decode, 10) == [0]


def test_a_ring_that_is_not_a_power_of_two_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        RingReader(-1, 3 * mmap.PAGESIZE)
