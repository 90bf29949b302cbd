"""A BPF ring buffer (BPF_MAP_TYPE_RINGBUF, Linux 5.8 on) read from Python through its shared memory.

bcc's own reader (`open_ring_buffer`, and `open_perf_buffer` alike) calls back into Python through ctypes once per
record, which costs more than decoding the record; this one hands a whole batch to the caller with no call into C.
The layout is the kernel's (include/uapi/linux/bpf.h, kernel/bpf/ringbuf.c): a page holding the consumer position
(written here), a page holding the producer position, then the data, mapped twice in a row so that a record that
wraps around the end reads as one piece. Each record is an 8-byte header (its length, with a busy bit while the
program is still writing it and a discard bit, then a page offset), the data, padded to 8 bytes.

Memory order: the positions and lengths are read and written with single native loads and stores (struct's native
formats copy them whole), and a record's data is read after its header says it is complete. That is the order the
kernel's reader relies on, as x86-64 keeps it for plain loads; on weaker orders (arm64) the interpreter runs far more
instructions between reading a header and reading its data than any CPU holds in flight.
"""

from __future__ import annotations

import mmap
import select
import struct
from collections.abc import Callable
from contextlib import ExitStack
from typing import TypeVar

T = TypeVar("T")

_POSITION = struct.Struct("@Q")
_LENGTH = struct.Struct("@I")
HEADER_SIZE = 8
BUSY = 1 << 31
DISCARDED = 1 << 30

Decode = Callable[[mmap.mmap, int], T]
"""(buffer, offset of a record's data in it) -> what the record means; called only during `drain`."""


class RingReader:
    """The records of one BPF ring buffer map (its file descriptor `map_fd`, `size` bytes of data), in the order
    the kernel reserved them; `wait` blocks until there is one, `drain` takes every complete one."""

    def __init__(self, map_fd: int, size: int) -> None:
        page = mmap.PAGESIZE
        if size < page or size & (size - 1):
            raise ValueError(f"a ring buffer of {size} bytes: it is a power of two of at least one page ({page})")
        self.size = size
        self._mask = size - 1
        self._data_at = page  # in `_producer`: the producer's page, then the data
        with ExitStack() as opened:
            read_write = mmap.PROT_READ | mmap.PROT_WRITE
            self._consumer = opened.enter_context(mmap.mmap(map_fd, page, mmap.MAP_SHARED, read_write, offset=0))
            self._producer = opened.enter_context(
                mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
            )
            self._epoll = opened.enter_context(select.epoll())
            self._epoll.register(map_fd, select.EPOLLIN)
            self._unmap = opened.pop_all().close

    def _positions(self) -> tuple[int, int]:
        return _POSITION.unpack_from(self._consumer)[0], _POSITION.unpack_from(self._producer)[0]

    def ready(self) -> bool:
        """Whether the oldest record not taken yet is complete (the program may still be writing it)."""
        consumer, producer = self._positions()
        if consumer == producer:
            return False
        return not _LENGTH.unpack_from(self._producer, self._data_at + (consumer & self._mask))[0] & BUSY

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the kernel's notice of a new record. It notices only a reader that has
        taken every record before it, so call this once `ready()` says no more is complete."""
        self._epoll.poll(timeout_s)

    def drain(self, decode: Decode[T], limit: int) -> list[T]:
        """`decode` each complete record, oldest first, up to `limit` of them or the first the program is still
        writing; then hand their space back to the kernel. Discarded records are skipped."""
        buffer, mask, data_at = self._producer, self._mask, self._data_at
        consumer, producer = self._positions()
        decoded: list[T] = []
        while consumer < producer and len(decoded) < limit:
            at = data_at + (consumer & mask)
            length = _LENGTH.unpack_from(buffer, at)[0]
            if length & BUSY:
                break
            if not length & DISCARDED:
                decoded.append(decode(buffer, at + HEADER_SIZE))
            consumer += ((length & ~DISCARDED) + HEADER_SIZE + 7) & ~7
        _POSITION.pack_into(self._consumer, 0, consumer)
        return decoded

    def close(self) -> None:
        """Unmap the buffer; the map itself lives on until its file descriptor and program are closed."""
        self._unmap()
