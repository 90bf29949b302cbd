"""Affinity keys, computed in the caller: ring positions, and prefix keys over token blocks.

`prefix_key` hashes a prompt the way engines hash their prefix cache: the tokens are cut into fixed-size
blocks and each block's hash chains the previous one's (`h_i = blake2b(h_(i-1) ‖ block_i)`, 64 bits), so
two prompts share block hash `i` exactly when their first `i` blocks are identical. The key is the chain's
last hash within the first `prefix_tokens` tokens (a prompt that ends inside that window adds its partial
last block), so it covers the shared system prompt *and* what follows it: conversations that share only
the system prompt get different keys, while the later turns of a conversation whose opening fills the
window keep its key.
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from collections.abc import Sequence

BLOCK_SIZE = 16
"""Tokens per block, vLLM's default KV-cache block size."""
PREFIX_TOKENS = 1024
"""How much of the prompt a prefix key covers: make it longer than the longest prompt prefix callers share."""
TEXT_BYTES_PER_TOKEN = 4
"""For text prompts, a block is `block_size * 4` bytes of UTF-8, about `block_size` tokens."""

_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN = 0x9E37_79B9_7F4A_7C15
"""2^64 / golden ratio: int keys are Fibonacci-hashed, `((key mod 2^64) * GOLDEN mod 2^64) >> 32`."""


def position(key: str | bytes | int) -> int:
    """The key's 32-bit position on a ring: CRC-32 of str (UTF-8) or bytes; an int is Fibonacci-hashed.

    CRC-32 is HAProxy's consistent-hash function; it spreads keys as evenly as a cryptographic hash would (the
    share of each node is dominated by where its points fall) at a tenth of the cost.
    """
    if isinstance(key, str):
        return zlib.crc32(key.encode())
    if isinstance(key, int):
        return ((key & _M64) * GOLDEN & _M64) >> 32
    return zlib.crc32(key)


def _chain(parent: int, block: bytes) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "big") + block, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except OverflowError:
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """The chained 64-bit hashes of the prompt's full blocks (a partial last block is not cached, so not listed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    data = _token_bytes(tokens)
    step = 4 * block_size
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(data) - step + 1, step):
        parent = _chain(parent, data[start : start + step])
        hashes.append(parent)
    return hashes


def prefix_key(
    tokens: Sequence[int] | None = None,
    *,
    text: str | None = None,
    block_size: int = BLOCK_SIZE,
    prefix_tokens: int = PREFIX_TOKENS,
) -> int:
    """The affinity key of a prompt given as token ids or as text (exactly one of the two).

    It is the chained hash of the blocks in the first `prefix_tokens` tokens (at least one block), including a
    partial last block when the prompt ends inside that window; an empty prompt gives 0.
    """
    if (tokens is None) == (text is None):
        raise ValueError("give either tokens or text")
    if block_size < 1 or prefix_tokens < 1:
        raise ValueError(f"block_size and prefix_tokens must be at least 1, got {block_size} and {prefix_tokens}")
    if tokens is not None:
        unit = 4
        data = _token_bytes(tokens[: max(block_size, prefix_tokens - prefix_tokens % block_size)])
    else:
        assert text is not None
        unit = TEXT_BYTES_PER_TOKEN
        window = max(block_size, prefix_tokens - prefix_tokens % block_size) * unit
        data = text.encode()[:window]
    step = unit * block_size
    key = 0
    for start in range(0, len(data), step):
        key = _chain(key, data[start : start + step])
    return key
