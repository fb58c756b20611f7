"""Prompt to token ids, exactly as the engine renders and tokenizes it.

The router hashes the tokens the engine caches, so it renders the chat template and
tokenizes with the served model's own tokenizer files (``transformers``), with vLLM's
defaults:

* chat: text parts of a message's ``content`` list are joined with ``"\\n"`` (vLLM's
  "string" content format, ``vllm/renderers/chat_utils.py`` ``_parse_chat_message_content_parts``
  in 0.32), ``None`` content becomes ``""``; ``tools``, ``chat_template_kwargs``,
  ``add_generation_prompt`` (default true) and ``continue_final_message`` enter the template;
  ``apply_chat_template(tokenize=True)`` encodes without special tokens (chat
  ``add_special_tokens=False``, ``chat_completion/protocol.py:337``).
* completions: a string prompt is encoded with ``add_special_tokens=True``
  (``completion/protocol.py:117``); a list of ints is used as is.

Requests whose cached blocks depend on more than text (images, audio, prompt embeddings,
several prompts in one request) or that the router cannot render get ``cacheable=False``:
they are routed by load, never on a hash that could match the wrong prefix. Rendering never
raises to the caller: the engine answers malformed requests with its own 400.

Tokenization parity with a real engine is checked in ``tests/integration/test_engine_parity.py``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_TEXT_PART_TYPES = {"text", "input_text"}


@dataclass
class PromptInfo:
    """What the router knows about a request's prompt.

    Attributes:
        token_ids: the prompt's token ids as the engine computes them (empty if not cacheable).
        cacheable: whether block hashes of ``token_ids`` predict the engine's cache.
        reason: why not cacheable ("" when cacheable).
        cache_salt: the request's ``cache_salt`` (mixed into block 0 by vLLM).
        lora_name: LoRA adapter name if ``model`` names one (mixed into every block).
    """

    token_ids: list[int] = field(default_factory=list)
    cacheable: bool = True
    reason: str = ""
    cache_salt: str | None = None
    lora_name: str | None = None
    rest: "PromptRest | None" = None

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens: exact when it is all encoded, else the encoded
        head plus ``rest.estimated_tokens``."""
        return len(self.token_ids) + (self.rest.estimated_tokens if self.rest else 0)

    def finish(self) -> None:
        """Encode the rest, if any: ``token_ids`` becomes the whole prompt's ids."""
        if self.rest is not None:
            self.token_ids = self.token_ids + self.rest.encode()
            self.rest = None


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
        tokens_per_byte: the head's density per UTF-8 byte, for ``estimated_tokens`` (per
            byte, not per character: byte-level BPE vocabularies spend tokens on bytes, so a
            rest in another script than the head is estimated better).
    """

    def __init__(self, encoder: "SegmentEncoder", chunks: list[str],
                 crossing: tuple[str, list[int]] | None, parts: list[str], parity: int,
                 suffix: list[int], tokens_per_byte: float):
        self.encoder, self.chunks, self.crossing = encoder, chunks, crossing
        self.parts, self.parity, self.suffix = parts, parity, suffix
        self.nbytes = sum(map(utf8_len, chunks)) + sum(map(utf8_len, parts))
        self.estimated_tokens = round(self.nbytes * tokens_per_byte) + len(suffix)

    def encode(self) -> list[int]:
        """The rest's token ids (exactly what encoding the whole text would give after the
        head's ids)."""
        out: list[int] = []
        if self.chunks:
            out = self.encoder._encode_chunks(self.chunks)
            if self.crossing is not None:
                piece, head_ids = self.crossing
                self.encoder._store(piece, head_ids + out)
        self.encoder._encode_parts(self.parts, self.parity, out)
        return out + self.suffix


def utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (an ASCII string's is its length, found without
    encoding; lone surrogates count 3 bytes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _content_to_text(content: Any) -> str | None:
    """vLLM's string-format content: a string, or text parts joined by newlines.

    Returns None when the content has a non-text part (image, audio, file...).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                return None
        return "\n".join(texts)
    return None


def _parse_tool_calls(calls: Any) -> list[dict] | None:
    """Assistant tool calls with JSON-string arguments parsed to dicts, as vLLM does."""
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for item in calls:
        if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
            raise ValueError("tool_calls entries must be objects with a function")
        fn = dict(item["function"])
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({**item, "function": fn})
    return out


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
            held as 4-byte words, about 2.5 bytes per character); least recently used
            pieces go first.
        min_chars: pieces shorter than this are encoded, not cached.
        chunk_chars: chunk length of long pieces encoded in parallel (0: never).
    """

    def __init__(self, tokenizer, max_chars: int = 8_000_000, min_chars: int = 512,
                 chunk_chars: int = 4096):
        self.max_chars, self.min_chars, self.chunk_chars = max_chars, min_chars, chunk_chars
        self._cache: OrderedDict[str, array] = OrderedDict()
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
    def _chunks(text: str, size: int) -> list[str] | None:
        """``text`` cut before single spaces that follow a non-space and precede a letter,
        at about every ``size`` characters; None if no such cut exists."""
        cuts, pos = [0], size
        while pos < len(text) - 1:
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

    def _encode_piece(self, piece: str) -> list[int]:
        """A long piece's ids through ``encode_batch``, which releases the GIL (``encode``
        holds it: a long prompt would stop the event loop and every other request)."""
        chunks = None
        if self.chunked and len(piece) > 2 * self.chunk_chars:
            chunks = self._chunks(piece, self.chunk_chars)
        return self._encode_chunks(chunks or [piece])

    def _encode_chunks(self, chunks: list[str]) -> list[int]:
        """The concatenated ids of ``chunks``, encoded by ``encode_batch`` on the tokenizer's
        thread pool, without the GIL."""
        return [i for enc in self._backend.encode_batch(chunks, add_special_tokens=False)
                for i in enc.ids]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the post-processor's special tokens (as
        ``tokenizer.encode(text, add_special_tokens=False)``). Thread-safe: encoding only
        reads the tokenizer (shared borrows), the cache has its own lock; so one huge prompt
        does not hold up the others."""
        out: list[int] = []
        self._encode_parts(self._split.split(text), 0, out)
        return out

    def encode_head(self, text: str, head_chars: int,
                    suffix: list[int] | None = None) -> tuple[list[int], PromptRest | None]:
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
        """
        suffix = list(suffix or [])
        if head_chars <= 0 or not self.chunked or len(text) <= head_chars:
            return self.encode(text) + suffix, None
        parts = self._split.split(text)
        out: list[int] = []
        used = nbytes = 0  # characters and UTF-8 bytes encoded
        for k, piece in enumerate(parts):
            if k % 2:
                out.append(self._ids[piece])
                used += len(piece)
                nbytes += utf8_len(piece)
                continue
            if not piece:
                continue
            if used >= head_chars:
                if self._uncached_chars(parts, k) > head_chars:
                    return out, PromptRest(self, [], None, parts[k:], k % 2, suffix,
                                           self._density(out, nbytes))
                self._encode_parts(parts[k:], k % 2, out)  # cheap: from the cache
                return out + suffix, None
            # a long piece that is not cached is cut, and the head ends inside it
            chunks = None
            if (used + len(piece) > head_chars and len(piece) > 2 * self.chunk_chars
                    and self._cached(piece) is None):
                chunks = self._chunks(piece, min(self.chunk_chars, max(head_chars, 256)))
                if chunks is None:  # no cut point (no spaces): the head ends before it
                    return out, PromptRest(self, [], None, parts[k:], k % 2, suffix,
                                           self._density(out, nbytes))
            if chunks is None:
                out.extend(self._piece(piece))
                used += len(piece)
                nbytes += utf8_len(piece)
                continue
            n = 0
            while n < len(chunks) and used < head_chars:
                used += len(chunks[n])
                nbytes += utf8_len(chunks[n])
                n += 1
            head = self._encode_chunks(chunks[:n]) if n else []
            out.extend(head)
            if n == len(chunks):  # the piece ended the head: cached like any other
                self._store(piece, head)
                continue
            return out, PromptRest(self, chunks[n:], (piece, head), parts[k + 1:], (k + 1) % 2,
                                   suffix, self._density(out, nbytes))
        return out + suffix, None

    # tokens per UTF-8 byte assumed when the head is too short to measure (English prose
    # runs at about 0.25 with byte-level BPE vocabularies of 150k tokens, code higher)
    DEFAULT_TOKENS_PER_BYTE = 0.3

    def _density(self, ids: list[int], nbytes: int) -> float:
        """Tokens per UTF-8 byte of a head, for the rest's estimated length."""
        return len(ids) / nbytes if nbytes >= 256 else self.DEFAULT_TOKENS_PER_BYTE

    def _encode_parts(self, parts: list[str], parity: int, out: list[int]) -> None:
        """Append the ids of split ``parts`` to ``out``; ``parts[i]`` is an added token
        when ``(i + parity)`` is odd."""
        for k, piece in enumerate(parts, parity):
            if k % 2:  # an added token
                out.append(self._ids[piece])
            elif piece:
                out.extend(self._piece(piece))

    def _uncached_chars(self, parts: list[str], start: int) -> int:
        """Characters of the pieces in ``parts[start:]`` (``start`` even: a piece) that
        encoding would have to tokenize (short ones, and long ones not in the cache)."""
        with self._cache_lock:
            return sum(len(p) for p in parts[start::2]
                       if len(p) < self.min_chars or p not in self._cache)

    def _cached(self, piece: str) -> array | None:
        with self._cache_lock:
            return self._cache.get(piece)

    def _piece(self, piece: str) -> list[int] | array:
        if len(piece) < self.min_chars:
            return self._backend.encode(piece, add_special_tokens=False).ids
        with self._cache_lock:
            ids = self._cache.get(piece)
            if ids is not None:
                self._cache.move_to_end(piece)
                self.hits += 1
                return ids
            self.misses += 1
        ids = self._encode_piece(piece)
        self._store(piece, ids)
        return ids

    def _store(self, piece: str, ids: list[int]) -> None:
        if len(piece) < self.min_chars or len(piece) > self.max_chars:
            return
        with self._cache_lock:
            if piece not in self._cache:
                self._cache[piece] = array("I", ids)
                self._chars += len(piece)
            while self._chars > self.max_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)


def _vllm_chat_request_model():
    """vLLM's own ``ChatCompletionRequest`` when vLLM is installed (it is wherever engines
    run); rendering then sees the request exactly as the engine's server does."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except Exception:  # no vLLM here: plain dicts (same result for ordinary requests)
        return None
    return ChatCompletionRequest


class PromptRenderer:
    """Renders and tokenizes requests with the served model's tokenizer.

    Args:
        tokenizer_path: a directory with ``tokenizer.json`` and ``tokenizer_config.json``
            (the engine's own files).
    Raises:
        OSError / ValueError: the tokenizer cannot be loaded (a start-up error: the router
            must not run without it, FAULTS.md 8.2).
    """

    def __init__(self, tokenizer_path: str, lora_names: frozenset[str] = frozenset()):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.lora_names = lora_names
        self._vllm_request = _vllm_chat_request_model()
        self._lock = threading.Lock()  # HF fast tokenizers are not re-entrant across threads
        self.segments = SegmentEncoder(self.tokenizer)
        self._special_affixes = self._find_special_affixes() if self.segments.usable else None
        if not getattr(self.tokenizer, "chat_template", None):
            logger.warning("tokenizer at %s has no chat template; chat requests will be "
                           "routed by load", tokenizer_path)

    def _find_special_affixes(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts before and after a text when a completion asks
        for special tokens (e.g. a BOS), or None if they cannot be told apart."""
        probe = "Special tokens probe."
        plain = self.tokenizer.encode(probe, add_special_tokens=False)
        full = self.tokenizer.encode(probe, add_special_tokens=True)
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return list(full[:i]), list(full[i + len(plain):])
        return None

    def render(self, path: str, body: dict[str, Any], head_chars: int = 0) -> PromptInfo:
        """Token ids of the request at ``path`` with JSON ``body``; never raises.

        With ``head_chars`` > 0, a long text prompt is encoded up to about that many
        characters and the rest is left in ``PromptInfo.rest`` (``finish()`` encodes it):
        the router needs the rest only when some replica holds the whole head
        (``SegmentEncoder.encode_head``). Not cacheable (routed by load) when the engine
        would not see the prompt the router renders: ``truncate_prompt_tokens`` (the engine
        drops tokens, by rules that vary with its version and tokenizer) or a chat template
        sent with the request.
        """
        if body.get("truncate_prompt_tokens") is not None:
            return PromptInfo(cacheable=False, reason="the engine truncates the prompt")
        if path == CHAT_PATH and body.get("chat_template") is not None:
            return PromptInfo(cacheable=False, reason="request carries its own chat template")
        try:
            info = (self._render_chat(body, head_chars) if path == CHAT_PATH
                    else self._render_completion(body, head_chars))
        except Exception as exc:  # the engine gives the authoritative 4xx for bad input
            logger.debug("prompt not rendered (%s): routing by load", exc)
            return PromptInfo(cacheable=False, reason=f"render failed: {type(exc).__name__}")
        if info.cacheable:
            salt = body.get("cache_salt")
            info.cache_salt = salt if isinstance(salt, str) and salt else None
            model = body.get("model")
            info.lora_name = model if model in self.lora_names else None
        return info

    def _render_chat(self, body: dict[str, Any], head_chars: int = 0) -> PromptInfo:
        tools = body.get("tools") or None
        messages = body.get("messages")
        if self._vllm_request is not None:
            # Validate as the engine does: its pydantic models fix the key order of
            # tool calls and fill tools' defaults, and both reach the template.
            req = self._vllm_request.model_validate(body)
            messages = req.messages
            tools = [t.model_dump() for t in req.tools] if req.tools else None
        if not isinstance(messages, list) or not messages:
            return PromptInfo(cacheable=False, reason="no messages")
        conversation = []
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                return PromptInfo(cacheable=False, reason="malformed message")
            text = _content_to_text(msg.get("content"))
            if text is None:
                return PromptInfo(cacheable=False, reason="non-text content")
            conv = {"role": msg["role"], "content": text}
            if msg["role"] == "assistant":
                calls = _parse_tool_calls(msg.get("tool_calls"))
                if calls:
                    conv["tool_calls"] = calls
                if msg.get("reasoning") is not None:
                    conv["reasoning"] = conv["reasoning_content"] = msg["reasoning"]
            elif msg["role"] == "tool" and "tool_call_id" in msg:
                conv["tool_call_id"] = msg["tool_call_id"]
            if "name" in msg and isinstance(msg["name"], str):
                conv["name"] = msg["name"]
            conversation.append(conv)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("add_generation_prompt", body.get("add_generation_prompt", True))
        kwargs.setdefault("continue_final_message", body.get("continue_final_message", False))
        if kwargs["continue_final_message"]:
            kwargs["add_generation_prompt"] = False
        if self.segments.usable:  # equal ids; repeated pieces are not encoded again
            with self._lock:
                text = self.tokenizer.apply_chat_template(
                    conversation, tools=tools if tools else None, tokenize=False, **kwargs)
            # outside the lock (see SegmentEncoder.encode)
            ids, rest = self.segments.encode_head(text, head_chars)
            return PromptInfo(token_ids=list(map(int, ids)), rest=rest)
        else:
            with self._lock:
                ids = self.tokenizer.apply_chat_template(
                    conversation, tools=tools if tools else None, tokenize=True,
                    return_dict=False, **kwargs)
        return PromptInfo(token_ids=list(map(int, ids)))

    def _render_completion(self, body: dict[str, Any], head_chars: int = 0) -> PromptInfo:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            if not prompt:
                return PromptInfo(cacheable=False, reason="empty prompt")
            add_special = bool(body.get("add_special_tokens", True))
            if self._special_affixes is not None:
                # piecewise and outside the lock, like chats: a huge prompt holds up no one
                before, after = self._special_affixes if add_special else ([], [])
                ids, rest = self.segments.encode_head(prompt, head_chars, after)
                return PromptInfo(token_ids=before + list(map(int, ids)), rest=rest)
            else:
                with self._lock:
                    ids = self.tokenizer.encode(prompt, add_special_tokens=add_special)
            return PromptInfo(token_ids=list(map(int, ids)))
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return PromptInfo(token_ids=list(prompt))
        return PromptInfo(cacheable=False, reason="prompt is not one text or token list")
