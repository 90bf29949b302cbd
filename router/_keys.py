"""Affinity keys, computed in the caller: ring positions, and prefix keys over token blocks.

`prefix_key` hashes a prompt the way engines hash their prefix cache: the tokens are cut into fixed-size
blocks and each block's hash chains the previous one's (`h_i = blake2b(h_(i-1) ‖ block_i)`, 64 bits), so
two prompts share block hash `i` exactly when their first `i` blocks are identical. The key is the chain's
last hash within the first `prefix_tokens` tokens (a prompt that ends inside that window adds its partial
last block), so it covers the shared system prompt *and* what follows it: conversations that share only
the system prompt get different keys, while the later turns of a conversation whose opening fills the
window keep its key.

`block_hashes` lists that chain block by block; it is what the router's cache index is keyed on. The agent
re-hashes every block its engine reports stored with the same `block_hash` (the engine's own hashes depend
on its hash seed, so no caller could compute them), so a caller's hashes of a prompt's token ids name the
blocks an engine caches. Three things decide whether they match:

- **Token ids and block size.** The ids must be the engine's (its tokenizer and chat template, e.g. vLLM's
  `/tokenize` or `/v1/chat/completions/render`), cut into the engine's block size (the agent reports it).
- **Extra keys.** vLLM hashes, beside each block's tokens, the block's *extra keys*: the LoRA adapter's name,
  `(identifier, offset in the block)` of each multimodal item overlapping the block (its placeholder tokens are
  the same for every image; the identifier is the content hash), and the `cache_salt` on the first block, in
  that order. The agent folds them in (`block_hash`'s `extra`: the block's token bytes followed by a canonical,
  length-prefixed encoding of its keys; a block without keys hashes its tokens alone), so a caller that gives
  `block_hashes(tokens, extra=...)` the same keys per block gets the engine's blocks, media parts included.
- **Text.** `text_block_hashes` keys a prompt given as text: its UTF-8 bytes in blocks of
  `block_size * TEXT_BYTES_PER_TOKEN`, on the same chain, and `media_block` chains a media part by its content
  id. These keys are the router's own (where it placed earlier requests with the same text): no engine block
  has them, since engines report token ids.
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from collections.abc import Sequence
from typing import TypeAlias

BLOCK_SIZE = 16
"""Tokens per block, vLLM's default KV-cache block size."""
PREFIX_TOKENS = 1024
"""How much of the prompt a prefix key covers: make it longer than the longest prompt prefix callers share."""
TEXT_BYTES_PER_TOKEN = 4
"""For text prompts, a block is `block_size * 4` bytes of UTF-8, about `block_size` tokens."""

_MAX_EXTRA_DEPTH = 8
"""Lists allowed within lists in extra keys (vLLM's go one deep), so that a hostile event cannot exhaust the stack."""
_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN = 0x9E37_79B9_7F4A_7C15
"""2^64 / golden ratio: int keys are Fibonacci-hashed, `((key mod 2^64) * GOLDEN mod 2^64) >> 32`."""

ExtraKey: TypeAlias = "str | bytes | int | None | Sequence[ExtraKey]"
"""One of a block's extra keys, as vLLM puts them in `extra_keys`: a LoRA name or cache salt (str), a
`(identifier, offset)` pair (a sequence; list and tuple encode alike, since msgpack carries tuples as lists)."""


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


def block_hash(parent: int, tokens: Sequence[int], extra: Sequence[ExtraKey] = ()) -> int:
    """One link of the chain: the block of `tokens` with its `extra` keys, after the block hashed `parent` (0 at
    the root). The agent re-hashes engine blocks with it; a caller may extend a chain it holds with it."""
    return _chain(parent, _token_bytes(tokens) + _extra_bytes(extra))


def block_hashes(
    tokens: Sequence[int], block_size: int = BLOCK_SIZE, *, extra: Sequence[Sequence[ExtraKey] | None] | None = None
) -> list[int]:
    """The chained 64-bit hashes of the prompt's full blocks (a partial last block is not cached, so not listed).

    `extra[i]` is block `i`'s extra keys (None or empty for none; entries past the last full block are not read):
    what vLLM puts in the block's `extra_keys`, so that media blocks, whose placeholder tokens are the same for
    every image, hash by the content of their media as the engine's do.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    data = _token_bytes(tokens)
    step = 4 * block_size
    hashes: list[int] = []
    parent = 0
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        keys = extra[i] if extra is not None and i < len(extra) else None
        parent = _chain(parent, data[start : start + step] + _extra_bytes(keys or ()))
        hashes.append(parent)
    return hashes


def text_block_hashes(text: str, block_size: int = BLOCK_SIZE, *, parent: int = 0) -> list[int]:
    """The chained hashes of the full blocks of `text`'s UTF-8 bytes, `block_size * TEXT_BYTES_PER_TOKEN` each,
    after `parent` (0 at the root; a `media_block` to go on after a media part).

    For callers without token ids. These keys match the router's own placements of the same text only, never an
    engine's KV events (those are token ids): an index fed by events does not know them. A partial last block is
    left out, as for tokens, so text that differs only in its last `block_size * TEXT_BYTES_PER_TOKEN - 1` bytes
    keys alike.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    data = text.encode()
    step = TEXT_BYTES_PER_TOKEN * block_size
    hashes: list[int] = []
    for start in range(0, len(data) - step + 1, step):
        parent = _chain(parent, data[start : start + step])
        hashes.append(parent)
    return hashes


def media_block(parent: int, content_id: str | bytes) -> int:
    """A media part (image, audio, video) as one link after `parent`, keyed by its content id (a hash of its
    bytes, say): `block_hash(parent, [], [content_id])`, the extra-key encoding the agent uses, over no tokens.

    For text callers (`text_block_hashes`): like their text blocks it matches the router's own placements only,
    since an engine's media blocks carry placeholder tokens and `(identifier, offset)` keys instead. A str id and
    its UTF-8 bytes are different ids (extra keys keep their type).
    """
    return _chain(parent, _extra_bytes((content_id,)))


def _extra_bytes(keys: Sequence[ExtraKey]) -> bytes:
    """A canonical, unambiguous encoding of extra keys: a type tag and a length before each value, so that no two
    different key lists encode alike (`("ab",)` is not `("a", "b")`, nor `"1"` the int 1). Empty for no keys."""
    out = bytearray()
    for key in keys:
        _encode_key(key, out, 1)
    return bytes(out)


def _encode_key(key: ExtraKey, out: bytearray, depth: int) -> None:
    if key is None:
        out += b"n"
    elif isinstance(key, str):
        data = key.encode()
        out += b"s" + len(data).to_bytes(4, "big") + data
    elif isinstance(key, bytes):
        out += b"b" + len(key).to_bytes(4, "big") + key
    elif isinstance(key, int) and not isinstance(key, bool):
        data = str(key).encode()
        out += b"i" + len(data).to_bytes(4, "big") + data
    elif isinstance(key, (list, tuple)):
        if depth > _MAX_EXTRA_DEPTH:
            raise ValueError(f"extra keys nested deeper than {_MAX_EXTRA_DEPTH}")
        out += b"l" + len(key).to_bytes(4, "big")
        for item in key:
            _encode_key(item, out, depth + 1)
    else:
        raise ValueError(f"an extra key must be str, bytes, int, None or a list of them, not {type(key).__name__}")


def prompt_cost(text: str | None) -> int:
    """`Request.cost` of a prompt given as text: its estimated tokens (UTF-8 bytes over TEXT_BYTES_PER_TOKEN, the
    estimate text blocks are cut by), at least 1, so that a caller without the model's tokenizer needs none."""
    if not text:
        return 1
    return max(1, -(-len(text.encode()) // TEXT_BYTES_PER_TOKEN))


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
