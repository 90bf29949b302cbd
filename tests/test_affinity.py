"""Affinity keys computed in the caller: chained block hashes, prefix keys, and the Mooncake conversation trace."""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections import Counter
from typing import Any

import pytest

from prismlb.router import (
    BLOCK_SIZE,
    PREFIX_TOKENS,
    TEXT_BYTES_PER_TOKEN,
    Router,
    Settings,
    block_hash,
    block_hashes,
    media_block,
    prefix_key,
    text_block_hashes,
)
from prismlb.sim import BLOCK_TOKENS, MOONCAKE_TRACE, mooncake_tokens, traces_dir
from prismlb.wire import RoutingTable, SliceTable, TableNode


def tokens(*blocks: int, block_size: int = BLOCK_SIZE, tail: int = 0) -> list[int]:
    """A prompt made of whole blocks, each block's tokens derived from its id, plus `tail` extra tokens."""
    out = [b * block_size + j for b in blocks for j in range(block_size)]
    return out + [7] * tail


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a = block_hashes(tokens(1, 2, 3, 4))
    b = block_hashes(tokens(1, 2, 9, 4))
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[3] != b[3]  # block 4 is the same, but it follows a different prefix
    assert block_hashes(tokens(1, 2, tail=BLOCK_SIZE - 1)) == a[:2]  # a partial last block is not cached
    assert block_hashes([]) == []
    assert block_hashes(tokens(1, 2, 3, 4), block_size=2 * BLOCK_SIZE) != a[1::2]  # other blocks, other chain
    assert len(block_hashes(tokens(1, 2, 3, 4), block_size=2 * BLOCK_SIZE)) == 2


def test_prefix_key_is_the_chain_hash_at_the_end_of_the_window() -> None:
    window_blocks = PREFIX_TOKENS // BLOCK_SIZE
    long_prompt = tokens(*range(window_blocks + 10))
    assert prefix_key(long_prompt) == block_hashes(long_prompt)[window_blocks - 1]
    # What comes after the window does not matter; anything inside it does.
    changed_after = tokens(*range(window_blocks), 999, 998)
    changed_inside = tokens(*range(window_blocks - 1), 999)
    assert prefix_key(changed_after) == prefix_key(long_prompt)
    assert prefix_key(changed_inside) != prefix_key(long_prompt)
    # A prompt that ends inside the window is keyed on all of it, partial last block included.
    short = tokens(1, 2, tail=3)
    assert prefix_key(short) not in (prefix_key(tokens(1, 2)), prefix_key(tokens(1, 2, tail=4)))
    assert prefix_key(short, prefix_tokens=2 * BLOCK_SIZE) == prefix_key(tokens(1, 2))
    assert prefix_key([]) == 0
    # Later turns of a conversation whose opening fills the window keep its key.
    turn_1 = tokens(*range(window_blocks + 2), tail=5)
    turn_2 = turn_1 + [11] * 700
    assert prefix_key(turn_2) == prefix_key(turn_1)


def test_text_prompts_are_keyed_on_their_first_bytes() -> None:
    system = "You are a helpful assistant. " * 20  # 580 bytes, shared by everyone
    a = system + "Tell me about the history of Rome, in detail. " * 200
    b = system + "Write a haiku about autumn leaves. " * 200
    assert prefix_key(text=a) != prefix_key(text=b)
    assert prefix_key(text=a) == prefix_key(text=a + "and more")
    assert prefix_key(text=system) != prefix_key(text=system + "x")
    assert prefix_key(text=a, prefix_tokens=100) == prefix_key(
        text=b, prefix_tokens=100
    )  # window inside the system prompt


def link(parent: int, data: bytes) -> int:
    """The chain as documented, written out: blake2b-64 of the parent (8 bytes, big-endian) and the block."""
    return int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "big") + data, digest_size=8).digest(), "big")


def test_block_hash_is_one_link_of_block_hashes() -> None:
    prompt = tokens(1, 2, 3, tail=5)
    chain = block_hashes(prompt)
    parent = 0
    for i, expected in enumerate(chain):
        block = prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        assert block_hash(parent, block) == link(parent, array("I", block).tobytes()) == expected
        parent = expected
    assert len(chain) == 3


def test_extra_keys_fold_into_their_block_and_everything_after() -> None:
    prompt = tokens(1, 2, 3)
    plain = block_hashes(prompt)
    cat = [None, [("sha256:cat", 4)], [("sha256:cat", 0)]]  # an image's placeholder tokens from block 1 on
    dog = [None, [("sha256:dog", 4)], [("sha256:dog", 0)]]
    with_cat, with_dog = block_hashes(prompt, extra=cat), block_hashes(prompt, extra=dog)
    assert with_cat[0] == with_dog[0] == plain[0]
    assert len({with_cat[1], with_dog[1], plain[1]}) == 3 and len({with_cat[2], with_dog[2], plain[2]}) == 3
    assert with_cat[1] == block_hash(plain[0], prompt[BLOCK_SIZE : 2 * BLOCK_SIZE], [("sha256:cat", 4)])
    assert block_hashes(prompt, extra=[(), [], None]) == plain  # a block without keys hashes its tokens alone
    assert block_hashes(prompt, extra=[None] * 5) == plain  # entries past the last full block are not read
    assert block_hashes(prompt, extra=cat[:2]) == [*with_cat[:2], block_hash(with_cat[1], prompt[2 * BLOCK_SIZE :])]


def test_extra_keys_encode_canonically() -> None:
    block = tokens(1)

    def keyed(*keys: Any) -> int:
        return block_hash(0, block, keys)

    assert keyed(("lora-a", ("sha256:cat", 4))) == keyed(["lora-a", ["sha256:cat", 4]])  # msgpack's lists alike
    distinct = [keyed(), keyed("ab"), keyed("a", "b"), keyed(("ab",)), keyed(b"ab"), keyed("1"), keyed(1), keyed(None)]
    assert len(set(distinct)) == len(distinct)
    assert keyed() == block_hash(0, block) == block_hashes(block)[0]
    for bad in (1.5, True, {"a": 1}):
        with pytest.raises(ValueError, match="extra key"):
            keyed(bad)
    nested: list[object] = ["deep"]
    for _ in range(7):
        nested = [nested]
    assert keyed(nested) != keyed(nested[0])  # eight lists deep: taken
    with pytest.raises(ValueError, match="nested deeper than 8"):
        keyed([nested])


def test_text_block_hashes_chain_blocks_of_utf8_bytes() -> None:
    step = BLOCK_SIZE * TEXT_BYTES_PER_TOKEN
    text = "é" * step  # two bytes a character: two blocks
    data = text.encode()
    first = link(0, data[:step])
    assert text_block_hashes(text) == [first, link(first, data[step:])]
    assert text_block_hashes(text + "partial") == text_block_hashes(text)  # a partial last block is left out
    assert text_block_hashes("short") == []
    head, tail = "a" * step, "b" * (2 * step)
    (head_hash,) = text_block_hashes(head)
    assert text_block_hashes(head + tail) == [head_hash, *text_block_hashes(tail, parent=head_hash)]
    assert text_block_hashes(text, block_size=2 * BLOCK_SIZE) == [link(0, data)]
    with pytest.raises(ValueError, match="at least 1"):
        text_block_hashes(text, block_size=0)


def test_media_block_chains_a_part_by_content_id() -> None:
    before = text_block_hashes("Describe the picture below in three sentences, please. " * 3)
    cat = media_block(before[-1], "sha256:cat")
    assert cat == block_hash(before[-1], [], ["sha256:cat"])  # the agent's extra-key encoding, over no tokens
    assert len({cat, media_block(before[-1], "sha256:dog"), media_block(0, "sha256:cat"), before[-1]}) == 4
    after = text_block_hashes("And now the one after it. " * 5, parent=cat)
    assert after != text_block_hashes("And now the one after it. " * 5, parent=media_block(before[-1], "sha256:dog"))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="either tokens or text"):
        prefix_key()
    with pytest.raises(ValueError, match="either tokens or text"):
        prefix_key([1], text="x")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        prefix_key([-1])
    with pytest.raises(ValueError, match="at least 1"):
        prefix_key([1], block_size=0)
    with pytest.raises(ValueError, match="at least 1"):
        block_hashes([1], block_size=0)


@pytest.fixture(scope="module")
def mooncake_prompts() -> list[list[int]]:
    """The first PREFIX_TOKENS tokens of the Mooncake conversation trace's prompts (all a key reads): each
    512-token block's tokens derived from its hash id (equal ids, equal blocks), cut to the input length; read
    once for the tests that use it."""
    trace = traces_dir() / MOONCAKE_TRACE
    if not trace.exists():
        pytest.skip(f"the Mooncake trace is not at {trace}")
    prompts = []
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        prompts.append(mooncake_tokens(row["hash_ids"], min(row["input_length"], PREFIX_TOKENS)))
    return prompts


def eight_nodes() -> Router:
    nodes = [TableNode(node_id=f"w{i}", endpoint=f"w{i}:8000", weight=1.0) for i in range(8)]
    table = RoutingTable(epoch=1, version=1, issued_unix_s=time.time(), slices=[SliceTable(name="llm", nodes=nodes)])
    return Router.from_table(table, settings=Settings(balance=0))


def max_over_mean(counts: Counter[str], nodes: int) -> float:
    return max(counts.values()) / (sum(counts.values()) / nodes)


def test_mooncake_keys_spread_where_first_block_keys_collapse(mooncake_prompts: list[list[int]]) -> None:
    prompts = mooncake_prompts
    router = eight_nodes()
    first_block = [prefix_key(p, block_size=BLOCK_TOKENS, prefix_tokens=BLOCK_TOKENS) for p in prompts]
    assert len(set(first_block)) == 1  # every request shares the first block: a system prompt
    assert max_over_mean(Counter(router.route(k).node_id for k in first_block), 8) == 8.0

    keys = [prefix_key(p) for p in prompts]  # defaults: 16-token blocks, the first 1,024 tokens
    assert len(set(keys)) > 7000
    assert max_over_mean(Counter(router.route(k).node_id for k in keys), 8) < 1.3
    # Keying on 512-token blocks gives the same grouping (the trace's blocks are 512 tokens).
    assert len(set(keys)) == len({prefix_key(p, block_size=BLOCK_TOKENS) for p in prompts})


def test_mooncake_turns_of_one_conversation_share_their_key(mooncake_prompts: list[list[int]]) -> None:
    prompts = mooncake_prompts
    by_opening: dict[tuple[int, ...], set[int]] = {}
    for prompt in prompts:
        if len(prompt) >= PREFIX_TOKENS:
            by_opening.setdefault(tuple(prompt[:PREFIX_TOKENS]), set()).add(prefix_key(prompt))
    assert len(by_opening) > 5000
    assert all(len(keys) == 1 for keys in by_opening.values())
    assert sum(1 for p in prompts if len(p) >= PREFIX_TOKENS) - len(by_opening) > 3000  # later turns, same key
