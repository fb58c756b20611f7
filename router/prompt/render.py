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

import functools
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from router.logs import get_logger
from router.prompt.segments import PromptRest, SegmentEncoder

logger = get_logger(__name__)

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
    """

    token_ids: list[int] = field(default_factory=list)
    cacheable: bool = True
    reason: str = ""
    cache_salt: str | None = None
    rest: "PromptRest | None" = None

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens: exact when it is all encoded, else the encoded
        head plus ``rest.estimated_tokens``."""
        return len(self.token_ids) + (self.rest.estimated_tokens if self.rest else 0)

    def finish(self, budget: int | None = None) -> bool:
        """Encode the rest, if any: ``token_ids`` becomes the whole prompt's ids (True).

        With a ``budget`` (tokens): only when the whole prompt is at most that long; False,
        and the prompt left as it is, as soon as it is found longer (``PromptRest.encode``:
        about ``budget`` tokens encoded at most).

        Raises:
            Exception: what the tokenizer raises for text it refuses (a lone surrogate).
        """
        if self.rest is None:
            return budget is None or len(self.token_ids) <= budget
        ids = self.rest.encode(None if budget is None else budget - len(self.token_ids))
        if ids is None:
            return False
        self.token_ids = self.token_ids + ids
        self.rest = None
        return True


_LAX_TRUE_STRINGS = {"1", "on", "t", "true", "y", "yes"}  # pydantic's, any case


def _lax_true(value: Any) -> bool:
    """Whether pydantic's lax ``bool`` reads ``value`` as true (vLLM's request models are
    pydantic): ``True``, the number 1, or one of its true words in any case."""
    if isinstance(value, str):
        return value.lower() in _LAX_TRUE_STRINGS
    return value is True or (isinstance(value, (int, float)) and value == 1)


def reads_no_cache(path: str, body: dict[str, Any]) -> bool:
    """Whether the engine computes the whole prompt of this request, cached blocks or not:
    vLLM skips reading its prefix cache for a request with prompt logprobs
    (``SamplingParams.skip_reading_prefix_cache``, ``vllm/sampling_params.py``: prompt
    logprobs of cached tokens are not computed), and a request asks for them with
    ``prompt_logprobs``, or with ``echo`` (true in pydantic's lax sense): for chat always
    (``top_logprobs`` stands in, and null reads as 0), for completions with ``logprobs``
    not null (``to_sampling_params`` of ``chat_completion/protocol.py`` and
    ``completion/protocol.py``, vLLM 0.32; ``tests/test_ingress_input.py`` checks the rule
    against them). Such a request is routed by load: no replica
    saves it any prefill (its blocks are still stored, and the engine's KV events bring
    them to the index)."""
    if body.get("prompt_logprobs") is not None:
        return True
    if not _lax_true(body.get("echo")):
        return False
    return path == CHAT_PATH or body.get("logprobs") is not None


def _scope(body: dict[str, Any]) -> str | None:
    """The tokenization cache's scope of a request (``SegmentEncoder``): its ``cache_salt``
    (the tenant's own under tenant isolation, ``router.serve.auth.tenant_cache_salt``), so
    that no request finds the pieces another scope sent; None without one."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def _has_tool_calls(messages: Any) -> bool:
    """Whether some message of a chat body carries ``tool_calls``."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("tool_calls") is not None for m in messages)


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


@functools.cache
def _vllm_chat_request_model():
    """vLLM's own ``ChatCompletionRequest`` when vLLM is installed (it is wherever engines
    run), else None; rendering then sees the request exactly as the engine's server does.
    Imported once per process (about 2.7 s of vLLM's modules on the 2-core VM)."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )
    except Exception:  # no vLLM here: plain dicts (same result for ordinary requests)
        return None
    return ChatCompletionRequest


class PromptRenderer:
    """Renders and tokenizes requests with the served model's tokenizer.

    Args:
        tokenizer_path: a directory with ``tokenizer.json`` and ``tokenizer_config.json``
            (the engine's own files).
        preload_request_model: import vLLM's request model (which validates requests with
            tools) now, at start-up, rather than on the first such request, where its
            import would hold the caller for seconds; False for a process that rarely
            sees tools and starts often (the simulated engine).
    Raises:
        OSError / ValueError: the tokenizer cannot be loaded (a start-up error: the router
            must not run without it, docs/fault-cases.md 8.2).
    """

    def __init__(self, tokenizer_path: str, preload_request_model: bool = True):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if preload_request_model:
            _vllm_chat_request_model()
        self._lock = threading.Lock()  # HF fast tokenizers are not re-entrant across threads
        self.segments = SegmentEncoder(self.tokenizer)
        self._special_affixes = self._find_special_affixes() if self.segments.usable else None
        if not getattr(self.tokenizer, "chat_template", None):
            logger.warning("tokenizer at %s has no chat template; chat requests will be "
                           "routed by load", tokenizer_path)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest token of the vocabulary, in characters of its vocabulary entry: vLLM's
        bound of a prompt's characters per token (``max(len(tok) for tok in vocab)``,
        ``vllm/tokenizers/hf.py``), which its server multiplies by the input-token limit
        before it tokenizes a prompt (``_text_len_check``, ``vllm/renderers/params.py``).
        At least 1. Computed once (a 152k-entry vocabulary: about 30 ms)."""
        return max((len(tok) for tok in self.tokenizer.get_vocab()), default=1) or 1

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
        sent with the request; and when the engine reads nothing from its prefix cache for
        the request (``reads_no_cache``).
        """
        if body.get("truncate_prompt_tokens") is not None:
            return PromptInfo(cacheable=False, reason="the engine truncates the prompt")
        if reads_no_cache(path, body):
            return PromptInfo(cacheable=False, reason="prompt logprobs: the engine reads no "
                                                      "cached block")
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
        return info

    def _render_chat(self, body: dict[str, Any], head_chars: int = 0) -> PromptInfo:
        tools = body.get("tools") or None
        messages = body.get("messages")
        if (tools is not None or _has_tool_calls(messages)) \
                and (request_model := _vllm_chat_request_model()) is not None:
            # Validate as the engine does: its pydantic models fix the key order of
            # tool calls and fill tools' defaults, and both reach the template. Only then:
            # the rest of a message reaches the template as sent, and the validation
            # took about 4 % of the ingress's CPU per request (loadtest.router_throughput's
            # profile).
            req = request_model.model_validate(body)
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
            ids, rest = self.segments.encode_head(text, head_chars, scope=_scope(body))
            return PromptInfo(token_ids=ids, rest=rest)  # a list of ints already
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
                ids, rest = self.segments.encode_head(prompt, head_chars, after,
                                                      scope=_scope(body))
                return PromptInfo(token_ids=before + list(map(int, ids)), rest=rest)
            else:
                with self._lock:
                    ids = self.tokenizer.encode(prompt, add_special_tokens=add_special)
            return PromptInfo(token_ids=list(map(int, ids)))
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return PromptInfo(token_ids=list(prompt))
        return PromptInfo(cacheable=False, reason="prompt is not one text or token list")
