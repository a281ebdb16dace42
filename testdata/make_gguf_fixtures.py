#!/usr/bin/env python3
"""GGUF fixtures written by llama.cpp's own converter (README.fixtures.md, "GGUF files written by
llama.cpp's own converter"): gguf/<family>.{bf16,q8_0}.gguf and gguf/<family>.q8_0.reference.safetensors.

For each family F (a folder hf/F):
  1. llama.cpp's convert_hf_to_gguf.py, run unmodified from LLAMA_CPP_DIR, converts hf/F with
     `--outtype bf16` and `--outtype q8_0` into gguf/F.{bf16,q8_0}.gguf. The fixtures' tokenizer is not
     one the converter knows by its hash, so its pre-tokenizer is declared `qwen2` (the regex it was
     trained with) by replacing TextModel.get_vocab_base_pre. Per-family workarounds (FAMILY_QUIRKS)
     are applied the same way, in this process, never to the files.
  2. transformers loads hf/F as make_fixtures.py does (bf16 weights, fp32 math), every weight that the
     q8_0 GGUF stores as Q8_0 is replaced by its Q8_0 round trip (gguf-py's own quantize/dequantize,
     rows along the input dimension) and checked equal, expert by expert, to the GGUF's own
     dequantized data; the `chat` and `long` prompts of hf/F/reference.safetensors are run and their
     ids and logits saved.

Usage: make_gguf_fixtures.py [--out DIR] FAMILY...   (DIR defaults to testdata/gguf; LLAMA_CPP_DIR
defaults to target/peer/llama_cpp_python-0.3.36/vendor/llama.cpp; transformers 5.17, torch 2.11)
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR") or os.path.join(
    HERE, "..", "target", "peer", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
sys.path.insert(0, LLAMA_CPP_DIR)
sys.path.insert(1, os.path.join(LLAMA_CPP_DIR, "gguf-py"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGUFReader, GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize, dequantize  # noqa: E402

torch.use_deterministic_algorithms(True)


def glm4_moe_quirks(family):
    """The converter's GLM-4.5 class writes GLM's own special tokens ([gMASK], <|user|>,
    <|observation|>) through AutoTokenizer.get_added_vocab(); the fixture has the shared Qwen-style
    tokenizer, without them (KeyError: '[gMASK]'). Its vocabulary is written the way every other
    family's is (TextModel.set_vocab, the byte-level BPE path, special ids from the checkpoint's
    config/tokenizer files). The checkpoint's config says num_nextn_predict_layers: 1 as GLM-4.5's does,
    but, like transformers' own Glm4MoeForCausalLM, it has no MTP layer weights: `--no-mtp` is the
    converter's own flag for that."""
    from conversion.base import TextModel
    from conversion.glm import Glm4MoeModel
    Glm4MoeModel.set_vocab = TextModel.set_vocab
    return ["--no-mtp"]


def glm_moe_dsa_quirks(family):
    """GLM-5's converter class (GlmMoeDsaModel) takes the same GLM vocabulary step as GLM-4.5
    (_set_vocab_glm: the pre-tokenizer hash check and GLM's [gMASK], <|user|>, <|observation|>
    tokens), which the fixture's shared Qwen-style tokenizer fails; its vocabulary is written by
    the generic byte-level BPE path (TextModel.set_vocab), as every other family's is. The
    fixture has no MTP layer and its config no num_nextn_predict_layers, so no flag is needed:
    the file has block_count 4 and no nextn_predict_layers. transformers 5.24's config fills
    indexer_types, so glm-dsa.attention.indexer.types is written."""
    from conversion.base import TextModel
    from conversion.glm import GlmMoeDsaModel
    GlmMoeDsaModel.set_vocab = TextModel.set_vocab
    return []


def qwen3_next_quirks(family):
    """The converter's Qwen3-Next / Qwen3.5 classes (_QwenMtpMixin) count the MTP layers from the
    checkpoint's `mtp.*` tensors and assert there is at least one unless `--no-mtp` is given; the
    fixtures, like what transformers saves, have no MTP layer. `--no-mtp`, the converter's own flag,
    gives 4 blocks and no nextn_predict_layers."""
    return ["--no-mtp"]


FAMILY_QUIRKS = {"glm4_moe": glm4_moe_quirks, "glm_moe_dsa": glm_moe_dsa_quirks, "qwen3_next": qwen3_next_quirks,
                 "qwen3_5_moe": qwen3_next_quirks}

# DeepSeek-V4 as deepseek-ai ships it (FP8 layers, FP4 experts): the converter always writes the
# experts as MXFP4 blocks and the dequantized FP8 layers as Q8_0 (its tensor_force_quant), the rest
# as stored, whatever --outtype says; its reference is made by v4_reference below.
#
# gpt-oss from the hub's MXFP4 layout: `--outtype bf16` keeps the experts' MXFP4 blocks (repacked
# to ggml's nibble order) and writes the rest bf16, so the fixture's own reference applies; no
# q8_0 file (its reference would need transformers on MXFP4 experts plus Q8_0 round trips).
#
# Qwen3-Next / Qwen3.5-MoE: bf16 only for now. The converter rewrites the Gated DeltaNet's tensors
# (A_log -> -exp(A_log), the zero-centred norms +1, in_proj_qkvz regrouped into attn_qkv + attn_gate,
# Qwen3.5's V heads reordered from grouped to tiled), which q8_0_reference's name-by-name check
# does not follow.
BF16_ONLY = {"gpt_oss_mxfp4", "deepseek_v4_fp4", "qwen3_next", "qwen3_5_moe"}


OUT = "gguf"


def convert(family, outtype):
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    extra = FAMILY_QUIRKS[family](family) if family in FAMILY_QUIRKS else []
    out = os.path.join(OUT, f"{family}.{outtype}.gguf")
    argv = [os.path.join(LLAMA_CPP_DIR, "convert_hf_to_gguf.py"), os.path.join("hf", family),
            "--outtype", outtype, "--outfile", out] + extra
    print("$", " ".join(argv[1:]), flush=True)
    saved = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = saved
    return out


def q8_0_roundtrip(t):
    a = t.detach().float().contiguous().numpy()
    return torch.from_numpy(dequantize(quantize(a, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                            .reshape(a.shape).astype(np.float32))


def hf_pieces(name, t):
    """(gguf-side hf name, tensor, setter) for each piece of a transformers parameter; fused expert
    tensors are split into the per-projection stacks the converter merges."""
    if name.endswith("experts.gate_up_proj"):
        p = name[: -len("gate_up_proj")]
        i = t.shape[1] // 2
        return [(p + "gate_proj.weight", t[:, :i]), (p + "up_proj.weight", t[:, i:])]
    if name.endswith("experts.down_proj"):
        return [(name + ".weight", t)]
    return [(name, t)]


def prompt_logits(model, ref, what):
    """`model`'s logits for the `chat` and `long` prompts of a fixture's reference, with how far
    they are from the reference's (`what` names the comparison; `{tag}` is the prompt)."""
    out = {}
    with torch.no_grad():
        for tag in ("chat", "long"):
            ids = ref[f"{tag}.input_ids"]
            out[f"{tag}.input_ids"] = ids.to(torch.int32).contiguous()
            out[f"{tag}.logits"] = model(ids.long().unsqueeze(0), use_cache=False).logits[0].float().contiguous()
            b = ref[f"{tag}.logits"]
            err = float((out[f"{tag}.logits"] - b).abs().max() / b.abs().max())
            top1 = float((out[f"{tag}.logits"].argmax(-1) == b.argmax(-1)).float().mean())
            print(f"{what.format(tag=tag)}: max rel err {err:.4f}, top-1 agreement {top1:.3f}")
    return out


def q8_0_reference(family, q8_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    d = os.path.join("hf", family)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16).float().eval()
    reader = GGUFReader(q8_path)
    arch = reader.fields["general.architecture"].contents()
    n_blocks = reader.fields[f"{arch}.block_count"].contents()
    tmap = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_blocks)
    gg = {t.name: t for t in reader.tensors}
    done, kept = set(), []
    with torch.no_grad():
        for name, p in model.named_parameters():
            for hf_name, piece in hf_pieces(name, p.data):
                gname = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if hf_name.endswith("kv_b_proj.weight") and gname not in gg:
                    kept.append(f"{gname}:split")  # DeepSeek: stored as attn_k_b / attn_v_b, F16
                    continue
                if gname is None or gname not in gg:
                    raise KeyError(f"{name} ({hf_name}) has no tensor in {q8_path}")
                t = gg[gname]
                if t.tensor_type != GGMLQuantizationType.Q8_0:
                    kept.append(f"{gname}:{t.tensor_type.name}")
                    continue
                rt = q8_0_roundtrip(piece)
                mine = rt
                if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    # the converter interleaves llama q/k rows for its rope; Q8_0 blocks lie within a
                    # row, so the round trip commutes with that row permutation
                    from conversion.llama import LlamaModel
                    cfg = model.config
                    kv = cfg.num_attention_heads if hf_name.endswith("q_proj.weight") else cfg.num_key_value_heads
                    mine = LlamaModel.permute(rt, cfg.num_attention_heads, kv)
                theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(rt.shape).astype(np.float32))
                for e in range(rt.shape[0] if rt.dim() == 3 else 1):
                    a, b = (mine[e], theirs[e]) if rt.dim() == 3 else (mine, theirs)
                    if not torch.equal(a, b):
                        raise AssertionError(f"{gname}[{e}]: round trip differs from the GGUF's own data")
                piece.copy_(rt)
                done.add(gname)
    missing = {n for n, t in gg.items() if t.tensor_type == GGMLQuantizationType.Q8_0} - done
    if missing:
        raise AssertionError(f"Q8_0 tensors not matched to a transformers parameter: {sorted(missing)}")
    print(f"{family}: {len(done)} Q8_0 tensors round-tripped and checked; kept as stored: {sorted(set(k.split(':', 1)[1] for k in kept))}")
    out = prompt_logits(model, ref, f"{family} {{tag}}: q8_0 vs bf16 reference")
    path = os.path.join(OUT, f"{family}.q8_0.reference.safetensors")
    save_file(out, path)
    os.chmod(path, 0o644)  # safetensors writes 0600
    return path


def v4_reference(family, path):
    """The reference of a DeepSeek-V4 GGUF: transformers in float32 on the weights the hub's codes
    stand for (FP8 blocks times their ue8m0 scales, FP4 codes times theirs), each layer the GGUF
    stores as Q8_0 replaced by its Q8_0 round trip, checked equal to the GGUF's own data; the
    MXFP4 experts checked equal to the FP4 weights (the same values, repacked)."""
    import glob, json, shutil, tempfile
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    d = os.path.join("hf", family)
    sd = {}
    for f in sorted(glob.glob(os.path.join(d, "model-*.safetensors"))):
        sd.update(load_file(f))
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w32 = {}
    for k, v in sd.items():
        if k.endswith(".scale") and k[:-6] + ".weight" in sd:
            continue
        s = sd.get(k[: -len("weight")] + "scale") if k.endswith(".weight") else None
        if s is None:
            w32[k] = v.float()
        elif v.dtype == torch.int8:
            u = v.view(torch.uint8).long()
            codes = torch.stack([u & 15, u >> 4], -1).reshape(v.shape[0], -1)
            w32[k] = lut[codes] * s.float().repeat_interleave(32, 1)
        else:
            w32[k] = v.float() * s.float().repeat_interleave(128, 0)[: v.shape[0]].repeat_interleave(128, 1)[:, : v.shape[1]]
    reader = GGUFReader(path)
    gg = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    tmap = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), reader.fields[f"{arch}.block_count"].contents())
    from conversion.deepseek import DeepseekV4Model
    names = DeepseekV4Model._map_dsv4_tensor_name
    q8 = 0
    for k in list(w32):
        if ".ffn.experts." in k or k.endswith("tid2eid"):
            continue
        bid = int(k.split(".")[1]) if k.startswith("layers.") else None
        key, suffix = names(None, k, bid)
        gname = gguf.TENSOR_NAMES[key].format(bid=bid) + suffix
        t = gg[gname]
        if t.tensor_type == GGMLQuantizationType.Q8_0:
            rt = q8_0_roundtrip(w32[k])
            theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(rt.shape).astype(np.float32))
            if not torch.equal(rt, theirs):
                raise AssertionError(f"{gname}: Q8_0 round trip differs from the GGUF's own data")
            w32[k] = rt
            q8 += 1
    for l in range(reader.fields[f"{arch}.block_count"].contents()):
        for proj, part in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            t = gg[f"blk.{l}.ffn_{part}_exps.weight"]
            theirs = dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1).astype(np.float32)
            mine = torch.stack([w32[f"layers.{l}.ffn.experts.{e}.{proj}.weight"] for e in range(t.data.shape[0])])
            if not np.array_equal(mine.numpy().reshape(theirs.shape), theirs):
                raise AssertionError(f"blk.{l}.ffn_{part}_exps: MXFP4 blocks differ from the FP4 weights")
    print(f"{family}: {q8} Q8_0 tensors round-tripped and checked, MXFP4 experts equal to the FP4 weights")
    ref = load_file(os.path.join(d, "reference.safetensors"))
    with tempfile.TemporaryDirectory() as f32:
        for f in os.listdir(d):
            if not f.startswith("model") and not f.startswith("reference"):
                shutil.copy(os.path.join(d, f), f32)
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        json.dump(cfg, open(os.path.join(f32, "config.json"), "w"), indent=2)
        save_file({k: v.contiguous() for k, v in w32.items()}, os.path.join(f32, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(f32, dtype=torch.float32).eval()
        out = prompt_logits(model, ref, f"{family} {{tag}}: GGUF (Q8_0 layers) vs the checkpoint's reference")
    path = os.path.join(OUT, f"{family}.bf16.reference.safetensors")
    save_file(out, path)
    os.chmod(path, 0o644)
    return path


def main():
    global OUT
    args = sys.argv[1:]
    if args[:1] == ["--out"]:
        OUT, args = os.path.abspath(args[1]), args[2:]
    os.chdir(HERE)
    os.makedirs(OUT, exist_ok=True)
    for family in args:
        bf16 = convert(family, "bf16")
        if family == "deepseek_v4_fp4":
            print("wrote", v4_reference(family, bf16))
        if family in BF16_ONLY:
            continue
        q8 = convert(family, "q8_0")
        print("wrote", q8_0_reference(family, q8))


if __name__ == "__main__":
    main()
