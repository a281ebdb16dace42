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
    // compressed-sparse (every 4, with the indexer). Stored per position today: the 512-value
    // key=value row of every layer's sliding branch, each compressor's raw [kv | gate] rows
    // (2 x 512 for HCA, 2 x 1024 for CSA plus the indexer's 2 x 256), and each entry's share.
    let flash = arch("deepseek-v4-flash");
    let ca = flash.compressed_attention.as_ref().unwrap();
    assert_eq!(ca.compression.iter().filter(|k| k.overlaps()).count(), 20);
    assert_eq!(kv_values_per_token(&flash), 43 * 512 + 23 * (2 * 512 + 4) + 20 * (2 * 1024 + 128 + 2 * 256 + 32));
}
