#!/usr/bin/env python3
"""Adds to the YaRN fixtures a reference that runs past `original_max_position_embeddings`.

The fixtures' `long` prompt is 300 tokens: past DeepSeek-V3-YaRN's original 256 positions, but
not past Qwen3-MoE-YaRN's 1024. This writes `reference_past.safetensors` beside each YaRN
fixture's `reference.safetensors`: a prompt of `--factor` x the original context (token ids from
the fixture tokenizer on this repository's own text, repeated), `past.input_ids` [T] (i32), and
transformers' logits of the last `--rows` positions (at most: only those past the original
context), `past.logits` [rows, vocab] (f32), whose
first position is `past.first` [1] (i32). The checkpoint is run as `make_fixtures.py` runs it:
loaded from disk in bf16, computed in f32.

Usage: python3 testdata/extend_yarn_references.py [--fixtures qwen3_moe_yarn,deepseek_v3_yarn]
Needs torch, transformers (the version the fixtures were made with: see hf/REPORT.json or
README.fixtures.md) and safetensors.
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))


def prompt_ids(tok, n):
    """n token ids of this repository's own text, repeated as needed."""
    text = open(os.path.join(HERE, "make_fixtures.py")).read() + open(__file__).read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="qwen3_moe_yarn,deepseek_v3_yarn")
    ap.add_argument("--factor", type=float, default=1.5, help="prompt length / original context")
    ap.add_argument("--rows", type=int, default=256, help="most positions at the end whose logits are kept")
    args = ap.parse_args()
    for name in args.fixtures.split(","):
        d = os.path.join(HERE, "hf", name)
        cfg = json.load(open(os.path.join(d, "config.json")))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        orig = scaling["original_max_position_embeddings"]
        n = int(orig * args.factor)
        assert n <= cfg["max_position_embeddings"], (name, n)
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
        ids = prompt_ids(tok, n)
        model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16).float().eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
        first = max(orig, n - args.rows)  # only positions past the original context
        save_file({"past.input_ids": torch.tensor(ids, dtype=torch.int32),
                   "past.logits": logits[first:].contiguous(),
                   "past.first": torch.tensor([first], dtype=torch.int32)},
                  os.path.join(d, "reference_past.safetensors"))
        print(f"{name}: {n} tokens (original context {orig}), logits of positions {first}..{n - 1}")


if __name__ == "__main__":
    main()
