"""Block hashes: vLLM 0.32's test vectors (reference section 3.3) and chain properties."""

from array import array

import pytest

from router.hashing import (BlockHasher, HashConfigError, HashSettings, cbor_head,
                            cbor_token_blocks, to_block_hash)


def hasher(**kw):
    return BlockHasher(HashSettings(**{"block_size": 32, "seed": "0", **kw}))


def counted(obj, name: str) -> list[int]:
    """Replace method ``name`` of ``obj`` by one that counts its calls; the count is the
    returned list's one item."""
    calls, fn = [0], getattr(obj, name)

    def counting(*args):
        calls[0] += 1
        return fn(*args)

    setattr(obj, name, counting)
    return calls


def test_xxhash_cbor_matches_vllm_test_vectors():
    h = hasher(hash_algo="xxhash_cbor")
    assert h.none_hash.hex() == "1ebe36576dcb573f26b99533a20aaeca"
    assert h.block_hashes(list(range(64))) == [3933666952306121906, 1283280737430802979]


def test_sha256_cbor_matches_vllm_test_vectors():
    h = hasher(hash_algo="sha256_cbor")
    assert h.none_hash.hex() == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
    assert h.block_hashes(list(range(64))) == [16788556735714370586, 10098319661985908792]


def test_cache_salt_uses_the_versions_own_encoding():
    assert hasher().block_hashes(list(range(32)), cache_salt="abc") == [16961449403433419312]
    assert hasher(extra_key_encoding="vllm-0.26").block_hashes(
        list(range(32)), cache_salt="abc") == [3136770795926885123]


def test_trailing_partial_block_is_not_hashed():
    h = hasher()
    assert h.block_hashes(list(range(31))) == []
    assert h.block_hashes(list(range(95))) == h.block_hashes(list(range(96)))[:2]


def test_each_block_hash_depends_on_its_parent():
    """docs/fault-cases.md 3.1: the same block content after a different prefix has another key."""
    h = hasher()
    a, b = list(range(32)), list(range(100, 132))
    ab = h.block_hashes(a + b)
    b_alone = h.block_hashes(b)
    assert ab[1] != b_alone[0]


def test_seed_changes_every_hash():
    assert hasher(seed="0").block_hashes(list(range(32))) != hasher(seed="1").block_hashes(
        list(range(32)))


def test_lora_and_salt_of_the_same_name_never_collide():
    """docs/fault-cases.md 3.4: tagged extra keys keep a LoRA named X apart from a salt X."""
    h = hasher()
    tokens = list(range(64))
    assert h.block_hashes(tokens, lora_name="X")[0] != h.block_hashes(tokens, cache_salt="X")[0]
    assert h.block_hashes(tokens, lora_name="X")[0] != h.block_hashes(tokens)[0]


def test_event_key_is_the_low_64_bits_big_endian():
    digest = bytes(range(16))
    assert to_block_hash(digest) == int.from_bytes(bytes(range(8, 16)), "big")
    assert to_block_hash(2**70 + 5) == 5


@pytest.mark.parametrize("kw", [{"hash_algo": "sha256"}, {"hash_algo": "xxhash"},
                                {"seed": ""}, {"block_size": 0}])
def test_settings_that_cannot_reproduce_the_engine_are_refused(kw):
    with pytest.raises(HashConfigError):
        HashSettings(**kw)


def test_mismatches_name_the_differing_settings():
    mine = HashSettings(block_size=32)
    assert mine.mismatches({"block_size": 16, "hash_algo": "xxhash_cbor", "seed": "0",
                            "extra_key_encoding": "vllm-0.32"}) == ["block_size"]


def _reference(hasher: BlockHasher, ids: list[int]) -> list[int]:
    """The chain computed block by block, without the hasher's cache."""
    bs, out, parent = hasher.settings.block_size, [], None
    for i in range(len(ids) // bs):
        parent = hasher.block_digest(parent, ids[i * bs:(i + 1) * bs])
        out.append(to_block_hash(parent))
    return out


def test_reused_digests_of_recent_prompts_equal_a_fresh_chain():
    """The cache of recent prompts' digests (keyed by the first block) is exact whatever
    the new prompt shares with the old: all of it, an extension (the next turn), a prefix,
    a divergence inside a block or at a block edge, another prompt with the same first
    block, and after the cache's LRU bound evicted it."""
    import random
    rng = random.Random(5)
    hasher = BlockHasher(HashSettings(block_size=16, hash_algo="xxhash_cbor", seed="0"),
                         recent=4)
    base = [rng.randrange(50_000) for _ in range(16 * 40 + 7)]
    variants = [base, base + [1, 2, 3] * 30, base[:16 * 12 + 5], base[:16 * 20],
                base[:16 * 20 + 3] + [9] + base[16 * 20 + 4:],  # differs inside block 20
                base[:16 * 25] + [7] * 16 + base[16 * 26:],     # block 25 replaced
                base[:16] + [rng.randrange(50_000) for _ in range(300)],  # same first block
                base[:15] + [0] + base[16:], base]
    for trial in range(200):
        ids = rng.choice(variants)
        if trial % 50 == 49:  # other prompts push the recent ones out
            for _ in range(6):
                other = [rng.randrange(50_000) for _ in range(64)]
                assert hasher.block_hashes(other) == _reference(hasher, other)
        got = hasher.block_hashes(ids)
        assert got == _reference(hasher, ids), trial
        assert [to_block_hash(d) for d in hasher.digests(ids)] == got
    assert len(hasher._recent) <= 4
    # negative ids (a bad completion request) are hashed without the cache, not refused
    assert hasher.block_hashes([-1] * 32) == _reference(hasher, [-1] * 32)


def test_a_conversations_next_turn_reuses_its_own_history_after_others_came_between():
    """Conversations sharing a system prompt take turns: each turn computes the digest of
    its first block, at most ``CHECKPOINT`` more to reach its own previous turn, and its
    new blocks, not its whole history after the system prompt (the cache found by first
    block alone held only the other conversation's latest turn)."""
    import random
    rng = random.Random(7)
    hasher = BlockHasher(HashSettings(block_size=16, hash_algo="xxhash_cbor", seed="0"))
    # the blocks hashed one by one, and those hashed from the bulk encoding
    counts = [counted(hasher, "block_digest"), counted(hasher, "_raw")]
    system = [rng.randrange(50_000) for _ in range(16 * 37 + 5)]
    convs = [list(system) for _ in range(4)]
    for turn in range(6):
        for c in convs:
            c += [rng.randrange(50_000) for _ in range(16 * 3)]  # 3 new blocks a turn
            before = sum(n[0] for n in counts)
            got = hasher.block_hashes(c)
            used = sum(n[0] for n in counts) - before
            assert got == _reference(hasher, c)
            if turn > 0:
                assert used <= 1 + BlockHasher.CHECKPOINT + 4, (turn, used)


def test_recent_prompt_cache_stays_within_its_token_budget():
    h = BlockHasher(HashSettings(block_size=16, hash_algo="xxhash_cbor", seed="0"),
                    recent=100, recent_tokens=200)
    for k in range(20):
        h.block_hashes([k * 1000 + i for i in range(64)])
    assert 0 < h._recent_bytes <= 8 * 200 and len(h._recent) == 3


# ids of every width of a CBOR unsigned int: 1 byte below 24, then 2, 3 and 5 bytes (9
# bytes from 2**32: no vocabulary is that large, and such prompts are hashed block by block)
_EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
_HUGE = [2**32, 2**64 - 1]


def test_bulk_encoding_is_cbor2s_encoding_of_each_block():
    """``cbor_token_blocks`` cuts one encoding of the whole prompt at the blocks' edges:
    each piece, behind the array head of a block, is cbor2's encoding of that block's
    tuple, for ids of every width and block sizes on both sides of the heads' 24."""
    import random

    import cbor2
    rng = random.Random(3)
    for bs in (16, 32, 24, 200):
        ids = [rng.choice(_EDGES) if rng.random() < 0.3 else rng.randrange(300_000)
               for _ in range(bs * 9 + 5)]
        buf, offs = cbor_token_blocks(array("Q", ids).tobytes(), bs)
        assert len(offs) == 10
        for i in range(9):
            assert cbor_head(4, bs) + buf[offs[i]:offs[i + 1]] == \
                cbor2.dumps(tuple(ids[i * bs:(i + 1) * bs]), canonical=True)
    for arg in (0, 23, 24, 255, 256, 65535, 65536):
        assert cbor_head(2, arg) + b"x" * arg == cbor2.dumps(b"x" * arg)
    for arg in _EDGES + _HUGE:
        assert cbor_head(0, arg) == cbor2.dumps(arg)
    assert cbor_token_blocks(array("Q", [1] * 31 + [2**32]).tobytes(), 32) is None


@pytest.mark.parametrize("algo", ["xxhash_cbor", "sha256_cbor"])
@pytest.mark.parametrize("encoding", ["vllm-0.32", "vllm-0.26"])
def test_bulk_hashes_equal_block_by_block_hashes(algo, encoding):
    """Prompts long enough for the bulk encoding (``BULK_MIN_BLOCKS`` and more) hash as the
    block-by-block chain does (``block_digest``, checked against vLLM's vectors above):
    plain, with a cache salt, with a LoRA adapter, and with both; ids of every width, and
    one past ``2**32``."""
    import random
    rng = random.Random(11)
    h = hasher(hash_algo=algo, extra_key_encoding=encoding)
    bs = h.settings.block_size
    for n_blocks, huge in ((BlockHasher.BULK_MIN_BLOCKS - 1, False),
                           (BlockHasher.BULK_MIN_BLOCKS, False), (40, False), (40, True)):
        ids = [rng.choice(_EDGES) if rng.random() < 0.2 else rng.randrange(150_000)
               for _ in range(n_blocks * bs + 3)]
        if huge:  # one id past 2**32: the whole prompt hashed block by block
            ids[n_blocks * bs // 2] = _HUGE[0]
        for salt, lora in ((None, None), ("s1", None), (None, "ad"), ("s1", "ad")):
            path = "/loras/ad" if lora else None
            parent, want = None, []
            for i in range(n_blocks):
                parent = h.block_digest(parent, ids[i * bs:(i + 1) * bs],
                                        h.block_extra_keys(i, salt, lora, path))
                want.append(to_block_hash(parent))
            assert h.block_hashes(ids, cache_salt=salt, lora_name=lora,
                                  lora_path=path) == want, (n_blocks, salt, lora)


def test_bulk_and_block_by_block_hashes_agree_on_random_prompts():
    """Random prompts over block sizes from 1 to 300 (the tokens' array head in each of its
    forms), lengths around ``BULK_MIN_BLOCKS`` and well past it, ids of every width, and the
    cache of recent prompts in play (prompts extending, cutting and changing earlier ones)."""
    import random
    rng = random.Random(17)
    for bs in (1, 3, 16, 23, 24, 25, 32, 64, 255, 256, 300):
        h = BlockHasher(HashSettings(block_size=bs, seed="7"), recent=8)
        earlier: list[list[int]] = []
        for _ in range(12):
            n = rng.choice((1, 7, 8, 9, 20, 70)) * bs + rng.randrange(bs)
            if earlier and rng.random() < 0.5:  # an earlier prompt extended, cut or changed
                ids = list(rng.choice(earlier))[:n] + [rng.randrange(40_000)
                                                       for _ in range(rng.randrange(3 * bs))]
                if ids and rng.random() < 0.3:
                    ids[rng.randrange(len(ids))] = rng.choice(_EDGES)
            else:
                ids = [rng.choice(_EDGES) if rng.random() < 0.1 else rng.randrange(151_936)
                       for _ in range(n)]
            earlier.append(ids)
            assert h.block_hashes(ids) == _reference(h, ids), (bs, len(ids))


def test_a_prompt_the_bulk_encoding_refuses_is_encoded_once_not_at_every_checkpoint():
    """An id of 2**32 or more (a completions request may send any) leaves a new prompt to
    be hashed block by block: its rest is tried for the bulk encoding once, not again at
    each checkpoint (which made the work grow with the square of the prompt's length)."""
    h = hasher()
    tries = counted(h, "_encode")
    ids = list(range(32 * 200)) + [2**32] * 32
    assert h.block_hashes(ids) == _reference(h, ids)
    assert tries == [1]
