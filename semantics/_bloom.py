"""Bloom filter over KV block hashes: the agent's counting filter and the pure look-ups the brain and router use.

Layout, shared by every reader of a `KvSummary`: `m = 8 * len(bloom)` bits, bit `i` is bit `i % 8` (least
significant first) of byte `i // 8`. A block hash is first made canonical (`block_key`: an int as its low 64 bits,
8 bytes big-endian, the form vLLM gives with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`; bytes as they are), then
`d = blake2b(key, digest_size=16)`, `h1` = first 8 bytes and `h2` = last 8 bytes (little-endian, `h2` made odd),
and its `k` positions are `(h1 + i * h2) mod m` for `i` in `0..k-1` (Kirsch-Mitzenmacher double hashing).

Defaults: `m = 131,072` bits (16 KiB, the wire's limit) and `k = 6`, designed for 16,384 blocks, where the
false-positive rate is `(1 - e^(-k n / m))^k` = 2.2%. More blocks still have no false negatives, but more false
positives (9.5% at 24,576, 22% at 32,768); `bloom_false_positive_rate` gives the rate for a summary's `blocks`.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence

from prismlb.wire import KvSummary

BLOOM_BITS = 131_072
BLOOM_HASHES = 6
BLOOM_CAPACITY = 16_384

BlockHash = int | bytes

_U64 = (1 << 64) - 1


def block_key(block_hash: BlockHash) -> bytes:
    """The canonical bytes of an engine block hash (int: its low 64 bits, big-endian; bytes: unchanged)."""
    if isinstance(block_hash, int):
        return (block_hash & _U64).to_bytes(8, "big")
    return bytes(block_hash)


def bloom_positions(block_hash: BlockHash, m_bits: int, k: int) -> list[int]:
    """The `k` bit positions of a block hash in an `m_bits` filter."""
    digest = hashlib.blake2b(block_key(block_hash), digest_size=16).digest()
    h1 = int.from_bytes(digest[:8], "little")
    h2 = int.from_bytes(digest[8:], "little") | 1
    return [(h1 + i * h2) % m_bits for i in range(k)]


def bloom_false_positive_rate(m_bits: int, k: int, n: int) -> float:
    """Expected false-positive rate of an `m_bits`, `k`-hash filter holding `n` distinct keys."""
    return (1.0 - math.exp(-k * n / m_bits)) ** k


def bloom_contains(summary: KvSummary, block_hash: BlockHash) -> bool:
    """Whether the summarised node may hold the block (never False for a block it holds)."""
    bits = summary.bloom
    if not bits:
        return False
    return all(bits[p >> 3] >> (p & 7) & 1 for p in bloom_positions(block_hash, 8 * len(bits), summary.bloom_hashes))


def bloom_overlap(summary: KvSummary, block_hashes: Sequence[BlockHash]) -> float:
    """Fraction of a request's prefix blocks, in order, the node may reuse: its longest cached leading run.

    Prefix caching reuses only a contiguous run of blocks from the start, so the first block not held ends
    the match. An empty sequence overlaps 0.0.
    """
    if not block_hashes:
        return 0.0
    held = 0
    for block_hash in block_hashes:
        if not bloom_contains(summary, block_hash):
            break
        held += 1
    return held / len(block_hashes)


class CountingBloom:
    """A Bloom filter with a counter per bit, so keys can be removed; `bits()` is the plain filter to send."""

    def __init__(self, m_bits: int = BLOOM_BITS, k: int = BLOOM_HASHES) -> None:
        if m_bits <= 0 or m_bits % 8 or m_bits > 8 * 16_384:
            raise ValueError(f"m_bits must be a positive multiple of 8 up to 131072, not {m_bits}")
        if not 1 <= k <= 16:
            raise ValueError(f"k must be 1 to 16, not {k}")
        self.m_bits = m_bits
        self.k = k
        self._counts = array("I", bytes(4 * m_bits))
        self._bits = bytearray(m_bits // 8)

    def add(self, block_hash: BlockHash) -> None:
        counts, bits = self._counts, self._bits
        for p in bloom_positions(block_hash, self.m_bits, self.k):
            if counts[p] == 0:
                bits[p >> 3] |= 1 << (p & 7)
            counts[p] += 1

    def remove(self, block_hash: BlockHash) -> None:
        """Undo one `add` of this hash (a hash never added must not be removed)."""
        counts, bits = self._counts, self._bits
        for p in bloom_positions(block_hash, self.m_bits, self.k):
            counts[p] -= 1
            if counts[p] == 0:
                bits[p >> 3] &= ~(1 << (p & 7)) & 0xFF

    def clear(self) -> None:
        self._counts = array("I", bytes(4 * self.m_bits))
        self._bits = bytearray(self.m_bits // 8)

    def bits(self) -> bytes:
        return bytes(self._bits)
