"""What a caller tells the router about a request: affinity key, modality, session, request class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from prismlb.semantics import MODALITY_HEADER, Slice, parse_signature

from ._keys import BLOCK_SIZE, PREFIX_TOKENS, ExtraKey, block_hashes, prefix_key, prompt_cost, text_block_hashes

SESSION_HEADER = "X-Session-Token"
CONTEXT_HEADER = "X-Context-Signature"
CLASS_HEADER = "X-Prism-Class"
AFFINITY_HEADER = "X-Prism-Affinity-Key"
TTFT_SLO_HEADER = "X-SLO-TTFT-Ms"
"""A request's own TTFT SLO in milliseconds (`Request.slo_s`), under the name llm-d's and the Gateway API inference
extension's SLO-aware schedulers read, so callers that already send it are understood as they are."""
CORE_CLASS = "core"

Key = str | bytes | int


@dataclass(frozen=True, slots=True)
class Request:
    """A request to place. Every field is optional.

    `key` is the affinity key (e.g. `prefix_key(tokens)`); without one, the session token is the key, and
    without either the request goes to a random point of the ring. The slice is `slice` when given, else
    the one `modality` (an `X-Modality-Signature`) names. `request_class` is what the guardian may shed.
    """

    key: Key | None = None
    modality: str | None = None
    slice: str | None = None
    session: str | None = None
    context_signature: str | None = None
    request_class: str = CORE_CLASS
    cost: int = 1
    """The request's prefill work (its prompt tokens) for a router that balances prefill (`Settings.load`)."""
    blocks: tuple[int, ...] = ()
    """The prompt's chained block hashes (`block_hashes`), which the router matches against the cluster's
    prefix index to expect each node's time to first token (`Settings.prefix_index`)."""
    block_size: int = BLOCK_SIZE
    """Tokens per block of `blocks`: the engines' KV block size."""
    engine_blocks: bool = True
    """Whether `blocks` are the engines' (from the prompt's token ids), which their KV events confirm and clear; False
    for `text_block_hashes`, which only routers' placements name, so no event says whether a node still holds them."""
    slo_s: float | None = None
    """The caller's TTFT target in seconds, which orders the requests the router holds back (`Settings.hold_tokens`);
    None: the project's rule (`semantics.ttft_slo_s`) over the slice's τ0 and the prompt's prefill on a typical node
    of the slice (`Group.slo_rate`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cost, int) or self.cost < 1:
            raise ValueError(f"cost must be a positive integer (prompt tokens), got {self.cost!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer (tokens), got {self.block_size!r}")
        if self.slo_s is not None and not self.slo_s > 0:
            raise ValueError(f"slo_s must be positive seconds or None, got {self.slo_s!r}")

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], *, key: Key | None = None, slice: str | None = None) -> Request:
        """A request described by its HTTP headers (any case): modality, session, context, class, affinity key.

        An explicit `key` wins over the `X-Prism-Affinity-Key` header.
        """
        lower = {name.lower(): value for name, value in headers.items()}
        return cls(
            key=key if key is not None else lower.get(AFFINITY_HEADER.lower()),
            modality=lower.get(MODALITY_HEADER.lower()),
            slice=slice,
            session=lower.get(SESSION_HEADER.lower()) or None,
            context_signature=lower.get(CONTEXT_HEADER.lower()) or None,
            request_class=lower.get(CLASS_HEADER.lower()) or CORE_CLASS,
        )

    def with_prompt(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        extra: Sequence[Sequence[ExtraKey] | None] | None = None,
        prefix_tokens: int = PREFIX_TOKENS,
    ) -> Request:
        """This request with what placement reads of its prompt, given as token ids or as text (exactly one): `cost`,
        the prompt's tokens; `blocks`, its chained block hashes of `block_size` tokens; and `key`, where it has
        none, the prompt's `prefix_key`. Without blocks the router can only follow the key (where it last sent it,
        else the ring); with them it places by expected time to first token over the cluster's prefix index.

        Token ids, the engine's (its tokenizer and chat template), name the blocks the engines' KV events name,
        so the index finds them on every node that holds them; `extra` gives each block's extra keys as the engine
        has them (`block_hashes`: a media part's content id), without which a prompt's blocks match only up to its
        first media part. Text is for callers without the model's tokenizer: its tokens are estimated from its
        UTF-8 bytes and its blocks are `text_block_hashes`, which match this router's own placements only."""
        if (tokens is None) == (text is None):
            raise ValueError("give either the prompt's tokens or its text")
        if extra is not None and tokens is None:
            raise ValueError("extra keys name token blocks: give the prompt's tokens with them")
        size = self.block_size
        key = (
            self.key
            if self.key is not None
            else prefix_key(tokens, text=text, block_size=size, prefix_tokens=prefix_tokens)
        )
        if tokens is not None:
            blocks = tuple(block_hashes(tokens, size, extra=extra))
            return replace(self, key=key, cost=max(1, len(tokens)), blocks=blocks, engine_blocks=True)
        assert text is not None
        blocks = tuple(text_block_hashes(text, size)) if text else ()
        return replace(self, key=key, cost=prompt_cost(text), blocks=blocks, engine_blocks=False)


@lru_cache(maxsize=512)
def slice_of(signature: str | None) -> Slice:
    """The modality slice a signature names (LLM when it is absent or unknown)."""
    return parse_signature(signature)[0]
