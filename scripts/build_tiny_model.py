#!/usr/bin/env python3
"""Build the tiny Llama-architecture test model (random weights) and a locally trained BPE tokenizer.

No model hub is contacted (HF_HUB_OFFLINE=1). Output is a Hugging Face folder (config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
special_tokens_map.json) in `--out` (default `$KVMESH_HOME/models/tiny-llama`, else
`~/.cache/kvmesh/models/tiny-llama`). Deterministic under `--seed`; idempotent: a folder whose
`kvmesh-tiny.json` records the same parameters is left as it is. Prints the folder path.

    python scripts/build_tiny_model.py [--out DIR] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPEC: dict[str, Any] = {
    "version": 2,
    "vocab_size": 1024,
    "hidden_size": 128,  # head_dim 32: the smallest vLLM CPU attention supports
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "corpus_lines": 4000,
}
SPECIALS = ["<unk>", "<s>", "</s>"]
# `<|role|>` turns; with `tools`, the Hermes function-calling prompt (NousResearch Hermes-2-Pro's, as
# Qwen2.5 ships it too): the functions in <tools></tools>, calls as <tool_call>{"name", "arguments"}</tool_call>
# (what vLLM's `hermes` tool parser reads), results in <tool_response></tool_response>. A chat without
# tools renders as it always did.
CHAT_TEMPLATE = (  # rendered with trim_blocks (transformers, as vLLM): a newline right after a tag is {{ "\n" }}
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with the user query. Don't "
    "make assumptions about what values to plug into functions. Here are the available tools: <tools>"
    '{% for t in tools %}{{ "\\n" }}{{ t | tojson }}{% endfor %}{{ "\\n" }}</tools>\nFor each function call, '
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n{% endif %}'
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% else %}{{ m['content'] }}"
    '{% for c in m.get("tool_calls") or [] %}{% if not loop.first or m["content"] %}{{ "\\n" }}{% endif %}'
    '<tool_call>\n{"name": {{ c["function"]["name"] | tojson }}, "arguments": '
    '{{ c["function"]["arguments"] | tojson }}}\n</tool_call>{% endfor %}{{ "\\n" }}{% endif %}{% endfor %}'
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_out() -> Path:
    home = os.environ.get("KVMESH_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "kvmesh"
    return base / "models" / "tiny-llama"


def corpus(seed: int, lines: int) -> list[str]:
    """Pseudo-English from a seeded generator: syllable words, punctuation, digits."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "n", "r", "s", "t", "nd", "ng", "ll"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(600)
    ]
    words += ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "user", "assistant", "system"]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 18)
        sent = " ".join(rng.choice(words) for _ in range(n))
        out.append(sent.capitalize() + rng.choice([".", "?", "!", ",", ":"]) + f" {rng.randint(0, 9999)}")
    return out


def build_tokenizer(seed: int, out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SPEC["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, SPEC["corpus_lines"]), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "model_max_length": SPEC["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"})
    )
    return tok


def build_model(seed: int, out: Path, vocab: int, bos: int, eos: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"],
        num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"],
        max_position_embeddings=SPEC["max_position_embeddings"],
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(out)


def spec_digest(seed: int) -> str:
    return hashlib.sha256(json.dumps({**SPEC, "seed": seed}, sort_keys=True).encode()).hexdigest()


def build(out: Path, seed: int = 0, force: bool = False) -> Path:
    """Build into `out` unless a matching build is already there; returns `out`."""
    marker = out / "kvmesh-tiny.json"
    digest = spec_digest(seed)
    if not force and marker.exists() and json.loads(marker.read_text()).get("digest") == digest:
        refresh_template(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=out.parent))
    try:
        tok = build_tokenizer(seed, tmp)
        build_model(seed, tmp, tok.get_vocab_size(), tok.token_to_id("<s>"), tok.token_to_id("</s>"))
        (tmp / "kvmesh-tiny.json").write_text(json.dumps({"digest": digest, "seed": seed, "spec": SPEC}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def refresh_template(out: Path) -> None:
    """A folder built before the template changed gets today's (the weights and vocabulary are the same):
    tokenizer_config.json is replaced in one rename, so a reader never sees half a file."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("chat_template") == CHAT_TEMPLATE:
        return
    cfg["chat_template"] = CHAT_TEMPLATE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    print(build(a.out or default_out(), a.seed, a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
