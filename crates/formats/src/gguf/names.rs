//! llama.cpp's names for architectures and tensors, and the transformations its converter
//! applies (Q/K row permutation for the `llama` architecture, DeepSeek's split of `kv_b_proj`).

use smoe_vault::Family;

/// The GGUF `general.architecture` of a family.
pub fn arch_name(f: Family) -> &'static str {
    match f {
        Family::Qwen3Moe => "qwen3moe",
        Family::Qwen2Moe => "qwen2moe",
        Family::Mixtral => "llama",
        Family::Olmoe => "olmoe",
        Family::Glm4Moe => "glm4moe",
        Family::DeepseekV3 => "deepseek2",
        Family::MinimaxM2 => "minimax-m2",
        Family::GptOss => "gpt-oss",
        Family::GlmMoeDsa => "glm-dsa",
        // No GGUF converter writes DeepSeek-V4 yet; export refuses it (see `smoe_convert`).
        Family::DeepseekV4 => "deepseek4",
        // Its linear-attention tensors have no GGUF names here yet: import and export refuse it.
        Family::Qwen3Next => "qwen3next",
        Family::Qwen35Moe => "qwen35moe",
    }
}

/// The GGUF tensor name of a canonical dense tensor of `family` (`None` for `attn.kv_b`, which
/// GGUF stores split into `attn_k_b` and `attn_v_b`).
pub fn tensor_name(family: Family, canonical: &str) -> Option<String> {
    if family == Family::DeepseekV4 {
        return deepseek_v4_tensor_name(canonical);
    }
    let fixed = match canonical {
        "embed" => "token_embd.weight",
        "final_norm" => "output_norm.weight",
        "lm_head" => "output.weight",
        _ => "",
    };
    if !fixed.is_empty() {
        return Some(fixed.into());
    }
    let rest = canonical.strip_prefix("layers.")?;
    let (layer, what) = rest.split_once('.')?;
    let g = match what {
        "attn_norm" => "attn_norm.weight",
        // llama.cpp's glm4moe and gpt-oss keep Hugging Face's name for the norm before the FFN.
        "ffn_norm" if matches!(family, Family::Glm4Moe | Family::GptOss | Family::Qwen3Next | Family::Qwen35Moe) => {
            "post_attention_norm.weight"
        }
        "ffn_norm" => "ffn_norm.weight",
        "attn.q" => "attn_q.weight",
        "attn.k" => "attn_k.weight",
        "attn.v" => "attn_v.weight",
        "attn.o" => "attn_output.weight",
        "attn.q_bias" => "attn_q.bias",
        "attn.k_bias" => "attn_k.bias",
        "attn.v_bias" => "attn_v.bias",
        "attn.q_norm" => "attn_q_norm.weight",
        "attn.k_norm" => "attn_k_norm.weight",
        "attn.q_a" => "attn_q_a.weight",
        "attn.q_a_norm" => "attn_q_a_norm.weight",
        "attn.q_b" => "attn_q_b.weight",
        "attn.kv_a" => "attn_kv_a_mqa.weight",
        "attn.kv_a_norm" => "attn_kv_a_norm.weight",
        "attn.kv_b" => return None,
        "mlp.gate" => "ffn_gate.weight",
        "mlp.up" => "ffn_up.weight",
        "mlp.down" => "ffn_down.weight",
        "attn.o_bias" => "attn_output.bias",
        "attn.sinks" => "attn_sinks.weight",
        "moe.router_logit_bias" => "ffn_gate_inp.bias",
        "moe.expert_gate_bias" => "ffn_gate_exps.bias",
        "moe.expert_up_bias" => "ffn_up_exps.bias",
        "moe.expert_down_bias" => "ffn_down_exps.bias",
        "moe.router" => "ffn_gate_inp.weight",
        "moe.router_bias" => "exp_probs_b.bias",
        "moe.shared.gate" => "ffn_gate_shexp.weight",
        "moe.shared.up" => "ffn_up_shexp.weight",
        "moe.shared.down" => "ffn_down_shexp.weight",
        "moe.shared_gate" => "ffn_gate_inp_shexp.weight",
        // GLM-5's DSA indexer.
        "attn.idx_q" => "indexer.attn_q_b.weight",
        "attn.idx_k" => "indexer.attn_k.weight",
        "attn.idx_k_norm" => "indexer.k_norm.weight",
        "attn.idx_k_norm_bias" => "indexer.k_norm.bias",
        "attn.idx_weights" => "indexer.proj.weight",
        // Qwen3-Next's and Qwen3.5's Gated DeltaNet. `lin.b`/`lin.a` are rows of qwen3next's
        // `ssm_ba`, `attn.q_gate` rows of `attn_q`, `lin.a_log` the log of `-ssm_a` (the
        // reader takes them apart: `smoe_formats::gguf::model`).
        "attn.q_gate" => "attn_q.weight",
        "lin.qkv" => "attn_qkv.weight",
        "lin.z" => "attn_gate.weight",
        "lin.b" if family == Family::Qwen35Moe => "ssm_beta.weight",
        "lin.a" if family == Family::Qwen35Moe => "ssm_alpha.weight",
        "lin.b" | "lin.a" => "ssm_ba.weight",
        "lin.conv" => "ssm_conv1d.weight",
        "lin.dt_bias" => "ssm_dt.bias",
        "lin.a_log" => return Some(format!("blk.{layer}.ssm_a")),
        "lin.norm" => "ssm_norm.weight",
        "lin.out" => "ssm_out.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// llama.cpp's `deepseek4` name of a canonical DeepSeek-V4 tensor (its converter's
/// `_map_dsv4_tensor_name`).
fn deepseek_v4_tensor_name(canonical: &str) -> Option<String> {
    let fixed = match canonical {
        "embed" => "token_embd.weight",
        "final_norm" => "output_norm.weight",
        "lm_head" => "output.weight",
        "hc_head_fn" => "output_hc_fn.weight",
        "hc_head_base" => "output_hc_base.weight",
        "hc_head_scale" => "output_hc_scale.weight",
        _ => "",
    };
    if !fixed.is_empty() {
        return Some(fixed.into());
    }
    let (layer, what) = canonical.strip_prefix("layers.")?.split_once('.')?;
    let g = match what {
        "attn_norm" => "attn_norm.weight",
        "ffn_norm" => "ffn_norm.weight",
        "hc_attn_fn" | "hc_attn_base" | "hc_attn_scale" | "hc_ffn_fn" | "hc_ffn_base" | "hc_ffn_scale" => {
            return Some(format!("blk.{layer}.{what}.weight"))
        }
        "attn.sinks" => "attn_sinks.weight",
        "attn.q_a" => "attn_q_a.weight",
        "attn.q_a_norm" => "attn_q_a_norm.weight",
        "attn.q_b" => "attn_q_b.weight",
        "attn.kv" => "attn_kv.weight",
        "attn.kv_norm" => "attn_kv_a_norm.weight",
        "attn.o_a" => "attn_output_a.weight",
        "attn.o_b" => "attn_output_b.weight",
        "attn.cmp_kv" => "attn_compressor_kv.weight",
        "attn.cmp_gate" => "attn_compressor_gate.weight",
        "attn.cmp_bias" => "attn_compressor_ape.weight",
        "attn.cmp_norm" => "attn_compressor_norm.weight",
        "attn.idx_q" => "indexer.attn_q_b.weight",
        "attn.idx_weights" => "indexer.proj.weight",
        "attn.idx_cmp_kv" => "indexer_compressor_kv.weight",
        "attn.idx_cmp_gate" => "indexer_compressor_gate.weight",
        "attn.idx_cmp_bias" => "indexer_compressor_ape.weight",
        "attn.idx_cmp_norm" => "indexer_compressor_norm.weight",
        "moe.router" => "ffn_gate_inp.weight",
        "moe.router_bias" => "exp_probs_b.bias",
        "moe.tid2eid" => "ffn_gate_tid2eid.weight",
        "moe.shared.gate" => "ffn_gate_shexp.weight",
        "moe.shared.up" => "ffn_up_shexp.weight",
        "moe.shared.down" => "ffn_down_shexp.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// The stacked expert tensor of part `gate`/`up`/`down` in layer `layer`.
pub fn expert_tensor(layer: usize, part: &str) -> String {
    format!("blk.{layer}.ffn_{part}_exps.weight")
}

/// llama.cpp's converter reorders the rows of q and k for the `llama` architecture so that its
/// adjacent-pair RoPE matches Hugging Face's half-split RoPE. For `heads` heads of `head_dim`
/// rows, returns the source row of each destination row.
pub fn llama_qk_permutation(heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src = vec![0; heads * head_dim];
    for h in 0..heads {
        for i in 0..half {
            for side in 0..2 {
                src[h * head_dim + 2 * i + side] = h * head_dim + side * half + i;
            }
        }
    }
    src
}

/// Inverse of a permutation.
pub fn invert(p: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; p.len()];
    for (dst, &src) in p.iter().enumerate() {
        inv[src] = dst;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm4moe_names_the_pre_ffn_norm_as_llama_cpp_loads_it() {
        // llama.cpp's glm4moe loader requires `post_attention_norm` and has no `ffn_norm`.
        let post = [Family::Glm4Moe, Family::GptOss, Family::Qwen3Next, Family::Qwen35Moe];
        for f in post {
            assert_eq!(tensor_name(f, "layers.3.ffn_norm").unwrap(), "blk.3.post_attention_norm.weight", "{f:?}");
        }
        for f in Family::ALL.into_iter().filter(|f| !post.contains(f)) {
            assert_eq!(tensor_name(f, "layers.3.ffn_norm").unwrap(), "blk.3.ffn_norm.weight", "{f:?}");
        }
    }
}
