//! KV-cache values per token for full-size published shapes, as stored (latent for MLA, kv
//! heads for GQA) vs. a naive full K/V cache; the numbers in docs/kv-cache.md.

use smoe_convert::synth;
use smoe_engine::{kv_values_per_token, naive_kv_values_per_token};
use smoe_formats::hf;

fn arch(shape: &str) -> smoe_vault::Architecture {
    hf::architecture_from_config(&synth::shape_config(shape).unwrap()).unwrap()
}

#[test]
fn kv_cache_values_per_token_for_published_shapes() {
    for shape in synth::shape_names() {
        let a = arch(shape);
        let (ours, naive) = (kv_values_per_token(&a), naive_kv_values_per_token(&a));
        println!("KV|{shape}|{ours}|{naive}|{:.1}", naive as f64 / ours as f64);
    }
    // DeepSeek-V3: 61 layers x (512 latent + 64 rope key) against 128 heads x (192 + 128).
    let ds = arch("deepseek-v3");
    assert_eq!(kv_values_per_token(&ds), 61 * 576);
    assert_eq!(naive_kv_values_per_token(&ds), 61 * 128 * 320);
    // GLM-4.5: 92 layers x 8 kv heads x 128 x (k + v) against 96 query heads.
    let glm = arch("glm-4.5");
    assert_eq!(kv_values_per_token(&glm), 92 * 8 * 128 * 2);
    assert_eq!(naive_kv_values_per_token(&glm), 92 * 96 * 128 * 2);
    // GLM-5: 78 layers x (512 + 64) latent, and a 128-value indexer key in each of the 78
    // layers that run an indexer; GLM-5.2 runs 21.
    assert_eq!(kv_values_per_token(&arch("glm-5")), 78 * 576 + 78 * 128);
    assert_eq!(kv_values_per_token(&arch("glm-5.2")), 78 * 576 + 21 * 128);
    // DeepSeek-V4-Flash: 43 layers, 23 heavily compressed (every 128 positions) and 20
    // compressed-sparse (every 4, with the indexer). Per position it keeps the entries' share:
    // 512 / 128 for HCA, 512 / 4 + 128 / 4 for CSA; its sliding rows (512 per layer) and the
    // compressors' raw rows are held for a bounded span only.
    let flash = arch("deepseek-v4-flash");
    let ca = flash.compressed_attention.as_ref().unwrap();
    assert_eq!(ca.compression.iter().filter(|k| k.overlaps()).count(), 20);
    assert_eq!(kv_values_per_token(&flash), 23 * 4 + 20 * (128 + 32));
    // Bounded: window 127 + rewind 512 (+ 128 slack) sliding rows of 512 in 43 layers; raw rows
    // of 2 x 512 over 128 + 512 (+ 128) positions in 23 HCA layers, of 2 x 1024 and 2 x 256 over
    // 8 + 512 (+ 128) in 20 CSA layers.
    let fixed = 43 * (127 + 512 + 128) * 512 + 23 * (128 + 512 + 128) * 1024 + 20 * (8 + 512 + 128) * (2048 + 512);
    assert_eq!(smoe_engine::kv_fixed_values(&flash), fixed);
    println!("KV-fixed|deepseek-v4-flash|{fixed}|{} MiB", (fixed * 4) >> 20);
    // gpt-oss-120b: 18 full attention layers of 8 kv heads x 64 (k + v) per position; its 18
    // sliding layers (window 128) hold 127 + rewind 512 (+ 128 slack) positions.
    let oss = arch("gpt-oss-120b");
    assert_eq!(kv_values_per_token(&oss), 18 * 8 * 64 * 2);
    assert_eq!(smoe_engine::kv_fixed_values(&oss), 18 * (127 + 512 + 128) * 8 * 64 * 2);
    println!("KV-fixed|gpt-oss-120b|{}|{} MiB", smoe_engine::kv_fixed_values(&oss), (smoe_engine::kv_fixed_values(&oss) * 4) >> 20);
    // Qwen3-Next-80B-A3B: 12 full attention layers of 2 kv heads x 256 (k + v); 36 Gated
    // DeltaNet layers hold no per-position state but a fixed one each: 3 convolution taps of
    // 8192 channels and 32 value heads' 128 x 128 matrices.
    let next = arch("qwen3-next-80b-a3b");
    assert_eq!(kv_values_per_token(&next), 12 * 2 * 256 * 2);
    assert_eq!(smoe_engine::kv_fixed_values(&next), 36 * (3 * 8192 + 32 * 128 * 128));
    println!("KV-fixed|qwen3-next-80b-a3b|{}|{} MiB", smoe_engine::kv_fixed_values(&next), (smoe_engine::kv_fixed_values(&next) * 4) >> 20);
    println!(
        "KV-fixed|deepseek-v4-pro|{}|{} MiB",
        smoe_engine::kv_fixed_values(&arch("deepseek-v4-pro")),
        (smoe_engine::kv_fixed_values(&arch("deepseek-v4-pro")) * 4) >> 20
    );
}

/// Bytes per token and per sequence with an f16 cache (`--kv-type f16`): half of f32's for
/// the decoder's own rows; the lightning indexer's keys (GLM-5) and recurrent states
/// (Qwen3-Next) stay f32.
#[test]
fn f16_kv_cache_halves_the_decoders_rows() {
    use smoe_engine::{kv_bytes, KvType};
    let qwen = arch("qwen3-30b-a3b");
    assert_eq!(kv_bytes(&qwen, KvType::F32), (48 * 4 * 128 * 2 * 4, 0));
    assert_eq!(kv_bytes(&qwen, KvType::F16), (48 * 4 * 128 * 2 * 2, 0));
    assert_eq!(kv_bytes(&arch("glm-5"), KvType::F16).0, 78 * 576 * 2 + 78 * 128 * 4);
    let next = arch("qwen3-next-80b-a3b");
    assert_eq!(kv_bytes(&next, KvType::F16), (12 * 2 * 256 * 2 * 2, 36 * (3 * 8192 + 32 * 128 * 128) * 4));
    // gpt-oss's sliding layers are decoder rows too: their bounded span halves as well.
    let oss = arch("gpt-oss-120b");
    assert_eq!(kv_bytes(&oss, KvType::F16), (18 * 8 * 64 * 2 * 2, 18 * (127 + 512 + 128) * 8 * 64 * 2 * 2));
    // DeepSeek-V4 keeps f32 (its f16 is refused when the model opens).
    let flash = arch("deepseek-v4-flash");
    assert_eq!(kv_bytes(&flash, KvType::F16), kv_bytes(&flash, KvType::F32));
}
