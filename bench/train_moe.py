#!/usr/bin/env python3
"""Train a small Qwen3-MoE-layout model whose expert rows are 256 wide, for the low-bit quality table.

K-quants (Q2_K ... Q6_K) store rows in super-blocks of 256 values; the bundled trained model
(`models/stdlib-moe`, hidden 128, expert width 64) is too narrow for them, so every K-quant request
on it falls back to a 32-block format and docs/quality.md had no Q2_K/Q3_K figure on a trained
model. This trains the same kind of model (same corpus, same tokenizer) with hidden 256 and expert
width 256, so that every expert matrix (gate and up: 256 columns of hidden; down: 256 of width)
takes K-quant blocks.

Corpus: the `.py` files of this Python's standard library, joined with `<|endoftext|>`, tokenized
with the demo model's tokenizer (models/stdlib-moe/tokenizer.json). The held-out texts of
`testdata/traces/trained_moe_48x6.safetensors` (`input_ids`, what `smoe perplexity --ids-file`
scores) are kept out: any file that contains the start of one of them is dropped.

Needs torch and transformers, and a CUDA GPU to train for real (the GPU machine has them). Writes a Hugging Face
checkpoint in bf16, in shards of at most 15 MB:

    python3 bench/train_moe.py OUT_DIR [--minutes 4] [--seed 0]
"""

import argparse
import glob
import json
import math
import os
import shutil
import sysconfig
import time

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models/stdlib-moe")
TRACE = os.path.join(ROOT, "testdata/traces/trained_moe_48x6.safetensors")
EOT = 1000


def corpus(tok, held_out):
    """Token ids of every stdlib file that holds none of the held-out texts' beginnings."""
    ids, kept, dropped = [], 0, 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"), recursive=True)):
        if "/test" in path or "site-packages" in path:
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        if any(h in text for h in held_out):
            dropped += 1
            continue
        ids.extend(tok.encode(text).ids)
        ids.append(EOT)
        kept += 1
    print(f"corpus: {kept} files, {len(ids)} tokens ({dropped} files dropped as held out)", flush=True)
    return torch.tensor(ids, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    # A GPU trains it in minutes; the CPU only runs a smoke test of the script (--minutes 0.1).
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(os.path.join(DEMO, "tokenizer.json"))
    trace = load_file(TRACE)["input_ids"].long()
    # The first 40 tokens of each held-out text, decoded: a file holding one is left out.
    held_out = [tok.decode(row[:40].tolist()) for row in trace]
    data = corpus(tok, held_out)

    cfg = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=EOT, eos_token_id=1002,
        output_router_logits=True, router_aux_loss_coef=0.01, initializer_range=0.02,
    )
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    budget, warm = args.minutes * 60, 100
    start, step = time.monotonic(), 0
    n = len(data) - args.seq
    model.train()
    while (elapsed := time.monotonic() - start) < budget:
        frac = elapsed / budget
        lr = 2e-3 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        at = torch.randint(0, n, (args.batch,))
        x = torch.stack([data[i : i + args.seq] for i in at]).to(dev)
        # Labels are the inputs: transformers shifts them (and adds the router's balance loss).
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0:
            print(f"step {step}  {elapsed:6.0f} s  loss {out.loss.item():.3f}  lr {lr:.2e}", flush=True)
        step += 1

    model.eval()
    with torch.no_grad():
        losses = []
        for row in trace:
            x = row.unsqueeze(0).to(dev)
            losses.append(model(input_ids=x, labels=x, use_cache=False).loss.item())
    print(f"trained {step} steps in {time.monotonic() - start:.0f} s; held-out loss (trace texts) "
          f"{sum(losses) / len(losses):.3f} nats/token", flush=True)

    model.config.output_router_logits = False
    model = model.to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size="15MB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(DEMO, f), args.out)
    with open(os.path.join(args.out, "TRAINING.json"), "w") as f:
        json.dump({"steps": step, "minutes": args.minutes, "seq": args.seq, "batch": args.batch, "seed": args.seed,
                   "held_out_loss": sum(losses) / len(losses), "parameters": params, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
