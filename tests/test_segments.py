"""The router's piecewise tokenization (``router.prompt.segments.SegmentEncoder``) gives exactly the
tokenizer's own ids, cold and from its cache, on chats with long and short messages,
unicode, whitespace at the pieces' edges and special-token strings inside user text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH, PromptRenderer
from router.prompt.segments import SegmentEncoder

MT_BENCH = Path(__file__).resolve().parent.parent / "loadtest" / "data" / "mt-bench" / \
    "question.jsonl"
ODD = ["", " ", "\n", "\n\n", "  x", "x  ", "héllo wörld ", "日本語のテキスト", "emoji 🙂🙂",
       "<|im_end|>", "a<|im_start|>b", "<|im_start|><|im_end|>", "<|endoftext|>\n",
       "tab\tand\r\nCRLF", "'s 're 've", "1234567890" * 3, "\u00e9 vs e\u0301 (NFC)"]


def _chats(seed: int, n: int):
    rng = random.Random(seed)
    turns = [t for line in MT_BENCH.read_text().splitlines() for t in json.loads(line)["turns"]]
    system = " ".join(rng.choice(turns) for _ in range(12))  # a long, repeated piece
    for _ in range(n):
        msgs = [{"role": "system", "content": system}]
        for k in range(rng.randrange(1, 6)):
            text = rng.choice(turns)
            if rng.random() < 0.5:
                text = rng.choice(ODD) + text + rng.choice(ODD)
            msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": text})
        yield msgs


@pytest.fixture(scope="module")
def renderer(model_dir):
    return PromptRenderer(str(model_dir))


def test_piecewise_ids_equal_the_tokenizers_cold_and_cached(renderer):
    tok = renderer.tokenizer
    enc = SegmentEncoder(tok, min_chars=16)
    assert enc.usable
    for msgs in _chats(0, 60):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = tok.encode(text, add_special_tokens=False)
        assert enc.encode(text) == want  # cold (or partly cached)
        assert enc.encode(text) == want  # every long piece from the cache
    for odd in ODD:
        assert enc.encode(odd) == tok.encode(odd, add_special_tokens=False), repr(odd)
    assert enc.hits > 60 and enc.misses > 0


def test_rendered_chats_equal_apply_chat_template(renderer):
    tok = renderer.tokenizer
    for msgs in _chats(1, 20):
        info = renderer.render(CHAT_PATH, {"model": "m", "messages": msgs})
        assert info.cacheable
        assert info.token_ids == tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_cache_stays_within_its_character_budget(renderer):
    enc = SegmentEncoder(renderer.tokenizer, max_chars=5_000, min_chars=100)
    for i in range(50):
        enc.encode(f"<|im_start|>user\n{'word ' * 100} {i}<|im_end|>")
    assert 0 < enc._chars <= 5_000 and len(enc._cache) < 50


def test_short_pieces_are_kept_in_a_bounded_table_with_the_tokenizers_ids(renderer):
    """Pieces under ``min_chars`` (role names, short messages) are encoded once and then
    looked up; the table is emptied when full, whatever clients send."""
    tok = renderer.tokenizer
    enc = SegmentEncoder(tok, min_chars=32)
    enc.SHORT_MAX = 50
    text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    want = tok.encode(text, add_special_tokens=False)
    assert enc.encode(text) == want and (None, "user\nhi there") in enc._short
    enc._backend = None  # a second encode must not need the tokenizer
    assert enc.encode(text) == want
    enc._backend = tok._tokenizer
    for i in range(500):
        piece = f"word {i} ü"
        assert enc.encode(piece) == tok.encode(piece, add_special_tokens=False)
        assert len(enc._short) <= 50


def test_tokenizers_whose_added_tokens_strip_whitespace_are_encoded_whole(model_dir):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_tokens([AddedToken("<sep>", lstrip=True)])
    assert not SegmentEncoder(tok).usable


def test_long_pieces_cut_for_parallel_encoding_give_the_same_ids(renderer):
    """Long pieces are cut before single spaces (Qwen2's pre-tokenizer cuts words there)
    and encoded in parallel: the same ids as one encode, on MT-Bench prose, the odd strings
    above and random unicode, with tiny chunks so that there are many cuts."""
    tok = renderer.tokenizer
    enc = SegmentEncoder(tok, min_chars=16, chunk_chars=20)
    assert enc.chunked
    rng = random.Random(3)
    turns = [t for line in MT_BENCH.read_text().splitlines() for t in json.loads(line)["turns"]]
    alphabet = "ab cdé 日本 🙂\n\t.,'s-_²1 " + "\u0301"
    texts = [" ".join(turns[:40]), " ".join(ODD * 5),
             "".join(rng.choice(alphabet) for _ in range(3000))]
    texts += [" ".join(rng.choice(turns) + rng.choice(ODD) for _ in range(30)) for _ in range(20)]
    for text in texts:
        assert enc._chunks(text, 20) is None or len(enc._chunks(text, 20)) > 1
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)


def test_other_pre_tokenizers_are_never_cut():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from router.prompt.segments import _splits_at_single_spaces
    sentencepiece_like = Tokenizer(models.BPE())
    sentencepiece_like.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not _splits_at_single_spaces(sentencepiece_like)


@pytest.mark.parametrize("head_chars", [1, 50, 700, 2_000])
def test_a_heads_ids_and_its_rests_give_the_whole_prompts_ids(model_dir, head_chars):
    """``render(head_chars=)`` cuts where encoding may cut: the head's ids followed by
    ``rest.encode()`` are the whole prompt's ids, for chats and completions (a BOS-free
    tokenizer here, but the completion's affixes are kept in order), cold and with the
    pieces cached by an earlier prompt. From a head of 100 tokens or more, the estimated
    length is within 20 % of the true one."""
    whole = PromptRenderer(str(model_dir))
    lazy = PromptRenderer(str(model_dir))
    lazy.segments.chunk_chars = 64  # many cuts, so the head ends inside long pieces
    cut = 0
    for msgs in _chats(4, 25):
        for path, body in ((CHAT_PATH, {"model": "m", "messages": msgs}),
                           (COMPLETIONS_PATH, {"model": "m",
                                               "prompt": " ".join(m["content"] for m in msgs)})):
            want = whole.render(path, body).token_ids
            info = lazy.render(path, body, head_chars)
            if info.rest is not None:
                cut += 1
                assert len(info.token_ids) < len(want)
                assert info.token_ids == want[:len(info.token_ids)]
                if len(info.token_ids) >= 100:
                    assert abs(info.num_tokens - len(want)) <= 0.2 * len(want)
            info.finish()
            assert info.rest is None and info.token_ids == want
            assert info.num_tokens == len(want)
    assert cut >= 10


def test_a_prompt_within_the_head_is_encoded_whole(renderer):
    info = renderer.render(CHAT_PATH, {"model": "m", "messages": [
        {"role": "user", "content": "short " * 50}]}, head_chars=8192)
    assert info.rest is None and info.num_tokens == len(info.token_ids) > 50


def test_a_long_piece_without_cut_points_is_left_whole_to_the_rest(renderer):
    """A long piece with no single space before a letter (CJK, base64) cannot be cut; the
    head ends before it, so encoding it happens only if needed (and off the event loop)."""
    text = "日本語のテキスト" * 3000  # 24k characters, no spaces
    msgs = [{"role": "system", "content": "Answer in Japanese. " * 20},
            {"role": "user", "content": text}]
    want = renderer.render(CHAT_PATH, {"model": "m", "messages": msgs}).token_ids
    info = PromptRenderer(renderer.tokenizer.name_or_path).render(
        CHAT_PATH, {"model": "m", "messages": msgs}, head_chars=2048)
    assert info.rest is not None and len(info.token_ids) < len(want) // 10
    assert info.token_ids == want[:len(info.token_ids)]
    info.finish()
    assert info.token_ids == want


def test_a_piece_cached_for_one_cache_salt_is_not_found_by_another(model_dir):
    """A security review: the tokenization cache was shared by every tenant, so a tenant
    could tell that another had sent a document, by the faster render (``server-timing``'s
    prepare: 1.0-1.8 ms against 3.2-5.3 ms) or by an exact token count where an estimate
    stood (the 429 of the tokens-per-minute limit). Pieces are now cached per
    ``cache_salt`` (the tenant's own under tenant isolation)."""
    r = PromptRenderer(str(model_dir))
    doc = "The quarterly figures of the secret merger, " * 450  # 20,250 characters

    def render(salt):
        body = {"model": "m", "messages": [{"role": "user", "content": doc}]}
        if salt is not None:
            body["cache_salt"] = salt
        return r.render(CHAT_PATH, body, head_chars=2048)

    first = render("tenant-a")
    assert first.rest is not None  # the document is new: an estimate past the head
    estimate = first.num_tokens
    first.finish()  # tenant a's whole prompt encoded and cached
    hits = r.segments.hits
    again = render("tenant-a")
    assert again.rest is None and r.segments.hits > hits  # a's own pieces: found
    for other in ("tenant-b", None):
        hits = r.segments.hits
        probe = render(other)
        assert probe.rest is not None and r.segments.hits == hits, other  # not found
        assert probe.num_tokens == estimate != again.num_tokens  # the estimate, not exact


def test_a_renderer_that_does_not_preload_vllms_model_validates_tools_all_the_same(
        renderer, model_dir):
    """The simulated engine's renderer leaves vLLM's request model (2.7 s of imports) to
    the first request with tools: that request is rendered as by a renderer that loaded it
    at start-up, tool defaults filled in by vLLM's model (without it, the template would
    see the tool as sent)."""
    from router.prompt import render as render_module
    render_module._vllm_chat_request_model.cache_clear()
    lazy = PromptRenderer(str(model_dir), preload_request_model=False)
    assert render_module._vllm_chat_request_model.cache_info().currsize == 0
    plain = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert lazy.render(CHAT_PATH, plain).token_ids == renderer.render(CHAT_PATH,
                                                                      plain).token_ids
    assert render_module._vllm_chat_request_model.cache_info().currsize == 0
    body = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    ids = lazy.render(CHAT_PATH, body).token_ids
    assert render_module._vllm_chat_request_model.cache_info().currsize == 1
    assert ids == renderer.render(CHAT_PATH, body).token_ids
    raw = renderer.tokenizer.apply_chat_template(plain["messages"], tools=body["tools"],
                                                 tokenize=False, add_generation_prompt=True)
    text = renderer.tokenizer.decode(ids)
    assert '"description": null' in text and text != raw  # vLLM's defaults, filled in
