"""Token ids of rendered chat text, piece by piece, as the tokenizer itself cuts it.

``SegmentEncoder`` encodes the pieces between a template's special tokens on their own and
keeps the long ones seen recently (a system prompt, earlier turns), so a follow-up turn pays
for its new message only; a long piece is cut where the tokenizer's own pre-tokenizer cuts
words and its chunks are encoded in parallel. ``PromptRest`` is what a long prompt's head
leaves to encode (``SegmentEncoder.encode_head``). Exactness is tested against the
tokenizer's own ids (``tests/test_segments.py``, ``tests/test_prompt_head.py``).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict

from router.logs import get_logger

logger = get_logger(__name__)

class PromptRest:
    """The part of a prompt after its encoded head (``PromptRenderer.render(head_chars=)``).

    Args:
        encoder: the ``SegmentEncoder`` that encoded the head.
        chunks: the unencoded chunks of the piece the head stopped in (possibly none).
        crossing: that piece and its head ids (cached whole once the rest is encoded), or
            None.
        parts: ``SegmentEncoder`` split parts after that piece (pieces at even positions,
            added tokens at odd ones, from ``parity``).
        suffix: ids the post-processor puts after the text (a completion's special tokens).
        scope: the cache scope of the head's encoding (``SegmentEncoder.encode_head``).
        tokens_per_byte: the head's density per UTF-8 byte, for ``estimated_tokens`` (per
            byte, not per character: byte-level BPE vocabularies spend tokens on bytes, so a
            rest in another script than the head is estimated better).
    """

    def __init__(self, encoder: "SegmentEncoder", chunks: list[str],
                 crossing: tuple[str, list[int]] | None, parts: list[str], parity: int,
                 suffix: list[int], tokens_per_byte: float, scope: str | None = None):
        self.encoder, self.chunks, self.crossing = encoder, chunks, crossing
        self.scope = scope
        self.parts, self.parity, self.suffix = parts, parity, suffix
        self.nbytes = sum(map(utf8_len, chunks)) + sum(map(utf8_len, parts))
        self.estimated_tokens = round(self.nbytes * tokens_per_byte) + len(suffix)

    GROUP = 8  # chunks encoded together between two counts, under a budget

    def encode(self, budget: int | None = None) -> list[int] | None:
        """The rest's token ids (exactly what encoding the whole text would give after the
        head's ids).

        With a ``budget`` (tokens), None as soon as more than ``budget`` are found: the rest
        is then encoded in groups of ``GROUP`` chunks (about 32k characters) and counted
        after each, so a rest far over ``budget`` costs about ``budget`` tokens of encoding,
        not its whole length (a tenant's token limit: a refused prompt must not cost the
        router the tokenization of megabytes, again and again). A long piece with no cut
        point (``SegmentEncoder._chunks``: CJK, base64) is one chunk, encoded whole. With
        no budget, each long piece's chunks go to the tokenizer in one batch (all its
        threads at once)."""
        enc, scope, suffix = self.encoder, self.scope, len(self.suffix)
        out: list[int] = []

        def over(n: int) -> bool:
            return budget is not None and n + suffix > budget

        def grouped(chunks: list[str]) -> list[int] | None:
            step = self.GROUP if budget is not None else max(len(chunks), 1)
            ids: list[int] = []
            for g in range(0, len(chunks), step):
                ids.extend(enc._encode_chunks(chunks[g:g + step]))
                if over(len(out) + len(ids)):
                    return None
            return ids

        if self.chunks:  # the last one is the piece's uncut rest (SegmentEncoder._chunks)
            ids = grouped(self.chunks[:-1] + enc._cut(self.chunks[-1]))
            if ids is None:
                return None
            out.extend(ids)
            if self.crossing is not None:
                piece, head_ids = self.crossing
                enc._store(piece, head_ids + out, scope)
        for k, piece in enumerate(self.parts, self.parity):
            if k % 2:  # an added token
                out.append(enc._ids[piece])
            elif piece:
                if budget is None or len(piece) <= self.GROUP * max(enc.chunk_chars, 1) \
                        or enc._cached(piece, scope) is not None:
                    ids = enc._piece(piece, scope)
                else:
                    ids = grouped(enc._cut(piece))
                    if ids is None:
                        return None
                    enc._store(piece, ids, scope)
                out.extend(ids)
            if over(len(out)):
                return None
        return out + self.suffix


def utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (an ASCII string's is its length, found without
    encoding; lone surrogates count 3 bytes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


# The pre-tokenizer of Qwen2 / Qwen2.5 tokenizers (tokenizer.json "pre_tokenizer"): a Split on
# this regex (GPT-4 style), then byte-level mapping without a prefix space.
_QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _splits_at_single_spaces(backend) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) cuts words as Qwen2's pre-tokenizer
    does, so that a text may be cut before a single space that follows a non-space and
    precedes a letter: the pattern's word-like alternatives never contain such a space, the
    whitespace ones never start after a non-space, and NFC never composes across a space."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return False
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    steps = pre.get("pretokenizers") or []
    return (pre.get("type") == "Sequence" and len(steps) == 2
            and steps[0].get("type") == "Split"
            and steps[0].get("pattern") == {"Regex": _QWEN2_SPLIT}
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("add_prefix_space")
            and (norm is None or norm.get("type") == "NFC"))


class SegmentEncoder:
    """Encodes rendered chat text piece by piece, with a cache of the long pieces.

    A fast tokenizer cuts its input at added tokens (``<|im_start|>``, ``<|im_end|>``...)
    before it normalizes and pre-tokenizes, and encodes each piece between them on its own
    (``tokenizers`` ``AddedVocabulary::extract_and_normalize``, leftmost-longest match). So
    ``encode(text)`` equals the concatenation of the pieces' encodings, and a piece seen
    before (a system prompt, an earlier turn of the conversation) need not be encoded again:
    a follow-up turn costs the tokenization of its new message only. This holds when no
    added token strips whitespace, matches single words only, or is matched after
    normalization; for other tokenizers ``usable`` is False and the caller encodes whole.

    A long piece is further cut into chunks of about ``chunk_chars`` where the tokenizer's
    own pre-tokenizer cuts words (only for the Qwen2-style pre-tokenizer, checked at start
    and by a self-test; see ``_splits_at_single_spaces``), and the chunks are encoded by
    ``encode_batch``, which runs them on the tokenizer's thread pool without the GIL: a
    long prompt's tokenization uses every core.

    Args:
        tokenizer: a ``transformers`` fast tokenizer.
        max_chars: bound of the cached pieces' total length (characters; with their ids,
            held as 4-byte words, about 2.5 bytes per character), each piece counted
            ``ENTRY_CHARS`` more for its entry's own objects (about 250 bytes: the string,
            the array, the dictionary slot); least recently used pieces go first.
        min_chars: pieces shorter than this are not in the LRU cache (a message of a few
            hundred characters costs 30-60 us to encode against under 1 us to look up, and
            a conversation sends each of its messages again with every turn); they are
            kept in a plain table of at most ``SHORT_MAX`` pieces, emptied when full (the
            role names and short messages of every chat, about 8 us each to encode).
        chunk_chars: chunk length of long pieces encoded in parallel (0: never).

    The cache is kept by scope (``encode``'s and ``encode_head``'s ``scope``: the request's
    ``cache_salt``, the tenant's under tenant isolation): a piece encoded in one scope is
    encoded again in another. Shared, a piece's hit (a faster render, which
    ``server-timing`` shows, and an exact token count where an estimate stood) would tell a
    tenant that another sent that text.
    """

    ENTRY_CHARS = 100  # a cached piece's own objects, in characters of the bound (~250 B)
    SHORT_MAX = 16384  # short pieces kept (under ``min_chars`` each: a few MB at most)

    def __init__(self, tokenizer, max_chars: int = 8_000_000, min_chars: int = 32,
                 chunk_chars: int = 4096):
        self.max_chars, self.min_chars, self.chunk_chars = max_chars, min_chars, chunk_chars
        # (scope, piece) -> ids (the class's docstring: a piece is cached in its scope)
        self._cache: OrderedDict[tuple[str | None, str], array] = OrderedDict()
        self._short: dict[tuple[str | None, str], list[int]] = {}  # under min_chars (the GIL)
        self._cache_lock = threading.Lock()  # encoding itself runs outside any lock
        self._chars = 0
        self.hits = self.misses = 0
        self.chunked = False
        backend = getattr(tokenizer, "_tokenizer", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        self.usable = backend is not None and bool(added) and all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        if not self.usable:
            return
        self._backend = backend
        # tokenizers >= 0.21: the same ids without each token's character offsets, about a
        # quarter less CPU (a 2,048-character head: 0.43 against 0.57 ms on the VM;
        # docs/benchmarks.md, "Where a burst request's time goes"); encode_batch before
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._ids = {t.content: i for i, t in added.items()}
        alternatives = sorted(self._ids, key=len, reverse=True)  # leftmost-longest
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self.chunked = chunk_chars > 0 and _splits_at_single_spaces(backend)
        if self.chunked and not self._self_test():
            logger.warning("chunked tokenization disagrees with the tokenizer on the "
                           "self-test text; long prompts are encoded whole")
            self.chunked = False

    def _self_test(self) -> bool:
        sample = ("The quick brown fox's 12 jumps (over 3.5 lazy dogs) — naïve café, "
                  "日本語 テキスト, emoji 🙂 a\u0301b; it'LL be   fine.\n\nNew para: x² y, "
                  "A_b c-d 'quoted' words\tand\r\nlines ") * 40
        chunks = self._chunks(sample, 37)
        return chunks is not None and self._encode_chunks(chunks) == \
            self._backend.encode(sample, add_special_tokens=False).ids

    @staticmethod
    def _chunks(text: str, size: int, upto: int | None = None) -> list[str] | None:
        """``text`` cut before single spaces that follow a non-space and precede a letter,
        at about every ``size`` characters; None if no such cut exists. With ``upto``, the
        cutting stops once the chunks cover ``upto`` characters and the last chunk is the
        rest of the text, uncut (a long prompt's head: its rest is cut when it is encoded,
        if ever)."""
        cuts, pos = [0], size
        while pos < len(text) - 1 and (upto is None or cuts[-1] < upto):
            i = text.find(" ", pos)
            while i != -1 and i < len(text) - 1 and not (
                    not text[i - 1].isspace() and text[i + 1].isalpha()):
                i = text.find(" ", i + 1)
            if i == -1 or i >= len(text) - 1:
                break
            cuts.append(i)
            pos = i + size
        if len(cuts) == 1:
            return None
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]

    def _cut(self, piece: str) -> list[str]:
        """``piece`` in chunks of about ``chunk_chars`` to encode in parallel, when it is
        long and this tokenizer's pieces may be cut; else ``[piece]``."""
        chunks = None
        if self.chunked and len(piece) > 2 * self.chunk_chars:
            chunks = self._chunks(piece, self.chunk_chars)
        return chunks or [piece]

    def _encode_piece(self, piece: str) -> list[int]:
        """A long piece's ids through ``encode_batch``, which releases the GIL (``encode``
        holds it: a long prompt would stop the event loop and every other request)."""
        return self._encode_chunks(self._cut(piece))

    def _encode_chunks(self, chunks: list[str]) -> list[int]:
        """The concatenated ids of ``chunks``, encoded by ``encode_batch_fast`` (or
        ``encode_batch``) on the tokenizer's thread pool, without the GIL."""
        return [i for enc in self._encode_batch(chunks, add_special_tokens=False)
                for i in enc.ids]

    def encode(self, text: str, scope: str | None = None) -> list[int]:
        """Token ids of ``text`` without the post-processor's special tokens (as
        ``tokenizer.encode(text, add_special_tokens=False)``). Thread-safe: encoding only
        reads the tokenizer (shared borrows), the cache has its own lock; so one huge prompt
        does not hold up the others. ``scope``: the cache's scope (the class's docstring)."""
        out: list[int] = []
        self._encode_parts(self._split.split(text), 0, out, scope)
        return out

    def encode_head(self, text: str, head_chars: int, suffix: list[int] | None = None,
                    scope: str | None = None) -> tuple[list[int], PromptRest | None]:
        """The ids of ``text``'s first ``head_chars`` characters or so, and its rest.

        The head ends after an added token, or between the chunks of a long piece that is
        not cached (see ``_chunks``), so head ids + ``rest.encode()`` equal
        ``encode(text)`` (+ ``suffix``). A rest is left only when it holds more than
        ``head_chars`` characters still to tokenize: text from the cache (a conversation's
        earlier turns) costs little and is encoded now. The rest is None then, for short
        texts, and when long pieces are not cut for this tokenizer.

        Args:
            head_chars: characters to encode at least (0: the whole text, no rest).
            suffix: ids that follow the text (kept for after the rest).
            scope: the cache's scope (the class's docstring), kept by the rest.
        """
        suffix = list(suffix or [])
        if head_chars <= 0 or not self.chunked or len(text) <= head_chars:
            return self.encode(text, scope) + suffix, None
        parts = self._split.split(text)
        out: list[int] = []
        used = nbytes = 0  # characters and UTF-8 bytes encoded
        for k, piece in enumerate(parts):
            if k % 2:  # an added token
                out.append(self._ids[piece])
                used += len(piece)
                nbytes += utf8_len(piece)
                continue
            if not piece:
                continue
            if used >= head_chars:  # the head ends before this piece
                return self._rest_at_piece(out, nbytes, parts, k, head_chars, suffix, scope)
            cut = self._cut_for_head(piece, head_chars - used, head_chars, scope)
            if cut is False:  # a long new piece with no cut point: the head ends before it
                return out, PromptRest(self, [], None, parts[k:], k % 2, suffix,
                                       self._density(out, nbytes), scope)
            if cut is None:  # the piece is encoded whole
                out.extend(self._piece(piece, scope))
                used += len(piece)
                nbytes += utf8_len(piece)
                continue
            n, chars, piece_bytes = self._chunks_for(cut, head_chars - used)
            used += chars
            nbytes += piece_bytes
            head = self._encode_chunks(cut[:n]) if n else []
            out.extend(head)
            if n == len(cut):  # the piece ended the head: cached like any other
                self._store(piece, head, scope)
                continue
            return out, PromptRest(self, cut[n:], (piece, head), parts[k + 1:], (k + 1) % 2,
                                   suffix, self._density(out, nbytes), scope)
        return out + suffix, None

    def _rest_at_piece(self, out: list[int], nbytes: int, parts: list[str], k: int,
                       head_chars: int, suffix: list[int],
                       scope: str | None) -> tuple[list[int], PromptRest | None]:
        """The head reached ``head_chars`` before piece ``parts[k]``: leave the rest for
        later when it still has more than ``head_chars`` characters to tokenize, else encode
        it now (from the cache, cheaply)."""
        if self._uncached_chars(parts, k, scope) > head_chars:
            return out, PromptRest(self, [], None, parts[k:], k % 2, suffix,
                                   self._density(out, nbytes), scope)
        self._encode_parts(parts[k:], k % 2, out, scope)
        return out + suffix, None

    def _cut_for_head(self, piece: str, room_chars: int, head_chars: int, scope: str | None):
        """How a piece with ``room_chars`` characters of head left is encoded: None when
        whole (it fits, is short, or is cached), its chunks when the head ends inside it,
        False when it should be cut but has no cut point (no spaces)."""
        if (len(piece) <= room_chars or len(piece) <= 2 * self.chunk_chars
                or self._cached(piece, scope) is not None):
            return None
        chunks = self._chunks(piece, min(self.chunk_chars, max(head_chars, 256)), room_chars)
        return False if chunks is None else chunks

    @staticmethod
    def _chunks_for(chunks: list[str], room_chars: int) -> tuple[int, int, int]:
        """How many leading ``chunks`` fill ``room_chars`` characters (at least until it is
        reached): (count, characters, UTF-8 bytes)."""
        n = chars = nbytes = 0
        while n < len(chunks) and chars < room_chars:
            chars += len(chunks[n])
            nbytes += utf8_len(chunks[n])
            n += 1
        return n, chars, nbytes

    # tokens per UTF-8 byte assumed when the head is too short to measure (English prose
    # runs at about 0.25 with byte-level BPE vocabularies of 150k tokens, code higher)
    DEFAULT_TOKENS_PER_BYTE = 0.3

    def _density(self, ids: list[int], nbytes: int) -> float:
        """Tokens per UTF-8 byte of a head, for the rest's estimated length."""
        return len(ids) / nbytes if nbytes >= 256 else self.DEFAULT_TOKENS_PER_BYTE

    def _encode_parts(self, parts: list[str], parity: int, out: list[int],
                      scope: str | None) -> None:
        """Append the ids of split ``parts`` to ``out``; ``parts[i]`` is an added token
        when ``(i + parity)`` is odd."""
        for k, piece in enumerate(parts, parity):
            if k % 2:  # an added token
                out.append(self._ids[piece])
            elif piece:
                out.extend(self._piece(piece, scope))

    def _uncached_chars(self, parts: list[str], start: int, scope: str | None) -> int:
        """Characters of the pieces in ``parts[start:]`` (``start`` even: a piece) that
        encoding would have to tokenize (short ones, and long ones not in the cache)."""
        with self._cache_lock:
            return sum(len(p) for p in parts[start::2]
                       if (scope, p) not in (self._short if len(p) < self.min_chars
                                             else self._cache))

    def _cached(self, piece: str, scope: str | None) -> array | None:
        with self._cache_lock:
            return self._cache.get((scope, piece))

    def _piece(self, piece: str, scope: str | None) -> list[int] | array:
        key = (scope, piece)  # the caches' key: a piece in its scope (the class's docstring)
        if len(piece) < self.min_chars:
            ids = self._short.get(key)
            if ids is None:
                ids = self._backend.encode(piece, add_special_tokens=False).ids
                if len(self._short) >= self.SHORT_MAX:  # bounded whatever clients send
                    self._short.clear()
                self._short[key] = ids
            return ids
        with self._cache_lock:
            ids = self._cache.get(key)
            if ids is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return ids
            self.misses += 1
        ids = self._encode_piece(piece)
        self._store(piece, ids, scope)
        return ids

    def _store(self, piece: str, ids: list[int], scope: str | None) -> None:
        if len(piece) < self.min_chars or len(piece) > self.max_chars:
            return
        key = (scope, piece)
        with self._cache_lock:
            if key not in self._cache:
                self._cache[key] = array("I", ids)
                self._chars += len(piece) + self.ENTRY_CHARS
            while self._chars > self.max_chars:
                (_, old), _ = self._cache.popitem(last=False)
                self._chars -= len(old) + self.ENTRY_CHARS
