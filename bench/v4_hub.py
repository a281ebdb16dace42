#!/usr/bin/env python3
"""A random-weight DeepSeek-V4 checkpoint of a published shape, as deepseek-ai ships it: the
linear layers of attention, of the indexer's queries and of the shared expert in float8 e4m3
with a ue8m0 `.scale` per 128x128 block, the routed experts in FP4 (int8-packed e2m1 codes, a
ue8m0 `.scale` per 32 columns), compressors, routers, norms and embeddings in bf16 or f32, the
hash layers' `tid2eid` as int32; config.json in the hub's spellings. What llama.cpp's converter
takes (it writes the experts as MXFP4 blocks and requantizes the float8 layers to Q8_0), so that
bench/peer.py can run both engines on the same GGUF.

Usage: bench/v4_hub.py OUT_DIR [--shape deepseek-v4-flash|deepseek-v4-pro] [--layers 4] [--first-layer 0]
                       [--tokenizer DIR]   (tokenizer.json and tokenizer_config.json to copy;
                                            default testdata/hf/deepseek_v4)

--first-layer F writes the published layers F..F+layers-1 (their compression ratios and hash or
learned routing) as the checkpoint's layers 0..: a cut that holds a compressed-sparse layer
without the heavy layers before it (V4-Pro's first is layer 3; four layers of it are ~53 GB).
Needs torch (with float8 dtypes), numpy and safetensors.
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))

# The published configurations, as `smoe synth` knows them (crates/convert/src/synth.rs).
PRO = {"vocab_size": 129280, "hidden_size": 7168, "moe_intermediate_size": 3072, "num_hidden_layers": 61,
       "num_attention_heads": 128, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536,
       "num_experts_per_tok": 6, "n_routed_experts": 384, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
       "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 1048576, "rope_theta": 10000,
       "compress_rope_theta": 160000, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 3,
       "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 16, "o_lora_rank": 1024, "index_n_heads": 64,
       "index_head_dim": 128, "index_topk": 1024, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
       "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
       "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
       "torch_dtype": "bfloat16"}
FLASH = dict(PRO, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
             n_routed_experts=256, routed_scaling_factor=1.5, o_groups=8, index_topk=512)


def ratios(layers):
    """Two heavily compressed layers, then compressed-sparse (odd) and heavy (even) alternating."""
    return [128 if (l < 2 or l % 2 == 0) else 4 for l in range(layers)]


def fp8(rows, cols, gen):
    """float8 e4m3 codes of N(0, 1/cols) weights with a power-of-two scale per 128x128 block."""
    w = torch.randn(rows, cols, generator=gen) / cols ** 0.5
    br, bc = -(-rows // 128), -(-cols // 128)
    pad = torch.zeros(br * 128, bc * 128)
    pad[:rows, :cols] = w
    amax = pad.reshape(br, 128, bc, 128).abs().amax((1, 3))
    scale = torch.exp2(torch.ceil(torch.log2((amax / 448).clamp(min=2.0 ** -126))))
    codes = (pad.reshape(br, 128, bc, 128) / scale[:, None, :, None]).reshape(br * 128, bc * 128)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu)


def fp4(rows, cols, rng):
    """FP4 e2m1 codes, two per byte, uniform; a ue8m0 scale per 32 columns around 2^-8 (an RMS
    near 1/sqrt(cols) for the shapes' widths)."""
    codes = torch.from_numpy(rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)).view(torch.int8)
    exps = torch.from_numpy(rng.integers(118, 121, size=(rows, cols // 32), dtype=np.uint8)).view(torch.float8_e8m0fnu)
    return codes, exps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--first-layer", type=int, default=0)
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "..", "testdata", "hf", "deepseek_v4"))
    args = ap.parse_args()
    cfg = dict({"deepseek-v4-flash": FLASH, "deepseek-v4-pro": PRO}[args.shape])
    L, F = args.layers, args.first_layer
    cfg["num_hidden_layers"] = L
    cfg["compress_ratios"] = ratios(F + L)[F:]
    cfg["num_hash_layers"] = max(0, min(cfg["num_hash_layers"] - F, L))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    os.makedirs(args.out, exist_ok=True)
    json.dump(cfg, open(os.path.join(args.out, "config.json"), "w"), indent=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.tokenizer, f), args.out)
    gen, rng = torch.Generator().manual_seed(1), np.random.default_rng(1)
    H, V, E, I = cfg["hidden_size"], cfg["vocab_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    nh, hd, r, g, olr = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    ih, ihd, m = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"]
    bf16 = lambda *s, std: (torch.randn(*s, generator=gen) * std).to(torch.bfloat16)
    ones = lambda n: (1 + 0.05 * torch.randn(n, generator=gen)).float()
    weight_map = {}

    def write(name, tensors):
        save_file(tensors, os.path.join(args.out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    write("model-embed.safetensors", {"embed.weight": bf16(V, H, std=0.05), "head.weight": bf16(V, H, std=H ** -0.5),
                                      "norm.weight": ones(H), "hc_head_fn": torch.randn(m, m * H, generator=gen) * 0.3 / (m * H) ** 0.5,
                                      "hc_head_base": torch.zeros(m), "hc_head_scale": torch.ones(1)})
    for l in range(L):
        t = {}
        p = f"layers.{l}."
        t[p + "attn_norm.weight"], t[p + "ffn_norm.weight"] = ones(H), ones(H)
        for blk in ("attn", "ffn"):
            t[p + f"hc_{blk}_fn"] = torch.randn((2 + m) * m, m * H, generator=gen) * 0.3 / (m * H) ** 0.5
            t[p + f"hc_{blk}_base"] = 0.1 * torch.randn((2 + m) * m, generator=gen)
            t[p + f"hc_{blk}_scale"] = torch.ones(3)
        for name, (rows, cols) in {"wq_a": (r, H), "wq_b": (nh * hd, r), "wkv": (hd, H), "wo_a": (g * olr, nh * hd // g),
                                   "wo_b": (H, g * olr)}.items():
            t[p + f"attn.{name}.weight"], t[p + f"attn.{name}.scale"] = fp8(rows, cols, gen)
        t[p + "attn.q_norm.weight"], t[p + "attn.kv_norm.weight"] = ones(r), ones(hd)
        t[p + "attn.attn_sink"] = 0.2 * torch.randn(nh, generator=gen)
        rate = cfg["compress_ratios"][l]
        c = 2 if rate == 4 else 1
        t[p + "attn.compressor.wkv.weight"] = bf16(c * hd, H, std=H ** -0.5)
        t[p + "attn.compressor.wgate.weight"] = bf16(c * hd, H, std=H ** -0.5)
        t[p + "attn.compressor.ape"] = 0.5 * torch.randn(rate, c * hd, generator=gen)
        t[p + "attn.compressor.norm.weight"] = ones(hd)
        if rate == 4:
            t[p + "attn.indexer.wq_b.weight"], t[p + "attn.indexer.wq_b.scale"] = fp8(ih * ihd, r, gen)
            t[p + "attn.indexer.weights_proj.weight"] = bf16(ih, H, std=H ** -0.5)
            t[p + "attn.indexer.compressor.wkv.weight"] = bf16(2 * ihd, H, std=H ** -0.5)
            t[p + "attn.indexer.compressor.wgate.weight"] = bf16(2 * ihd, H, std=H ** -0.5)
            t[p + "attn.indexer.compressor.ape"] = 0.5 * torch.randn(rate, 2 * ihd, generator=gen)
            t[p + "attn.indexer.compressor.norm.weight"] = ones(ihd)
        t[p + "ffn.gate.weight"] = bf16(E, H, std=H ** -0.5)
        if l < cfg["num_hash_layers"]:
            k = cfg["num_experts_per_tok"]
            t[p + "ffn.gate.tid2eid"] = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(V)]).astype(np.int32))
        else:
            t[p + "ffn.gate.bias"] = 0.1 * torch.randn(E, generator=gen)
        for name, (rows, cols) in {"w1": (I, H), "w3": (I, H), "w2": (H, I)}.items():
            t[p + f"ffn.shared_experts.{name}.weight"], t[p + f"ffn.shared_experts.{name}.scale"] = fp8(rows, cols, gen)
        write(f"model-layer{l}.safetensors", t)
        experts = {}
        for e in range(E):
            for name, (rows, cols) in {"w1": (I, H), "w3": (I, H), "w2": (H, I)}.items():
                experts[p + f"ffn.experts.{e}.{name}.weight"], experts[p + f"ffn.experts.{e}.{name}.scale"] = fp4(rows, cols, rng)
        write(f"model-layer{l}-experts.safetensors", experts)
        print(f"layer {l} (published {F + l}): compress ratio {rate}, {'hash' if l < cfg['num_hash_layers'] else 'learned'} routing",
              flush=True)
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(args.out, "model.safetensors.index.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
