//! Format tests on small synthetic vaults: round trip, corruption, truncation, versions,
//! atomicity. Converter tests on real checkpoints live in smoe-convert.

use crate::*;
use std::io::{Seek, SeekFrom, Write};

pub(crate) fn tiny_arch() -> Architecture {
    Architecture {
        family: Family::Qwen3Moe,
        vocab_size: 16,
        hidden_size: 32,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 16,
        max_position_embeddings: 128,
        norm_eps: 1e-6,
        rope: Rope {
            theta: 10000.0,
            rotary_dim: 16,
            partial_rotary_factor: 1.0,
            interleaved: false,
            scaling: RopeScaling::None,
            sections: Vec::new(),
        },
        qk_norm: QkNorm::PerHead,
        qkv_bias: false,
        mla: None,
        dense_intermediate_size: 0,
        moe: Moe {
            num_experts: 4,
            top_k: 2,
            intermediate_size: 32,
            router: Router::Softmax,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            shared_experts: None,
            router_logit_bias: false,
            expert_bias: false,
            expert_act: Default::default(),
            hash_layers: vec![],
        },
        layers: vec![LayerKind::Moe; 2],
        tie_word_embeddings: false,
        attention_windows: vec![],
        attn_sinks: false,
        o_bias: false,
        sparse_attention: None,
        compressed_attention: None,
        hyper_connections: None,
        linear_attention: None,
        attn_output_gate: false,
    }
}

fn manifest(arch: &Architecture) -> Manifest {
    Manifest {
        created_by: "test".into(),
        required_features: vec![],
        architecture: arch.clone(),
        source_config: serde_json::json!({}),
        text: TextAssets { tokenizer_json: "{}".into(), ..Default::default() },
        generation: GenerationDefaults::default(),
        dense: vec![],
        experts: ExpertIndex { blob_size: 0, parts: vec![], layers: vec![] },
        notes: vec![],
    }
}

/// Writes a vault whose every byte is a function of its position, so reads can be checked.
fn write_tiny(path: &std::path::Path) -> Architecture {
    let arch = tiny_arch();
    let mut w = VaultWriter::create(path).unwrap();
    for spec in names::dense_tensors(&arch) {
        let format = if spec.keep_f32 { Format::F32 } else { Format::BF16 };
        let n: usize = spec.shape.iter().product();
        let bytes: Vec<u8> = (0..n * format.block_bytes()).map(|i| (i * 7 + spec.name.len()) as u8).collect();
        w.add_tensor(&spec.name, format, &spec.shape, &bytes, "src").unwrap();
    }
    let shapes = names::expert_part_shapes(&arch);
    let parts: Vec<_> = names::EXPERT_PARTS.iter().zip(shapes).map(|(n, s)| (n.to_string(), Format::Q8_0, s)).collect();
    let (parts, blob_size) = layout_blob(&parts, 4096).unwrap();
    w.begin_experts(parts.clone(), blob_size, &arch.moe_layers(), arch.moe.num_experts).unwrap();
    for l in arch.moe_layers() {
        for e in 0..arch.moe.num_experts {
            let data: Vec<Vec<u8>> = parts.iter().map(|p| vec![(l * 16 + e) as u8; p.len as usize]).collect();
            let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            w.add_blob(l, e, &refs).unwrap();
        }
    }
    w.finish(manifest(&arch)).unwrap();
    arch
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    let arch = write_tiny(&path);
    let v = Vault::open(&path).unwrap();
    assert_eq!(v.architecture(), &arch);
    assert_eq!(v.header().alignment, 4096);
    let e = v.dense("layers.1.attn.q").unwrap();
    assert_eq!(e.format, Format::BF16);
    let b = v.read_dense("layers.1.attn.q").unwrap();
    assert_eq!(b[3], (3 * 7 + "layers.1.attn.q".len()) as u8);
    let mut blob = vec![0u8; v.manifest().experts.blob_size as usize];
    v.read_blob(1, 3, &mut blob).unwrap();
    assert_eq!(blob[0], 16 + 3);
    assert_eq!(v.blob(1, 3).unwrap().offset % 4096, 0);
    v.verify(&mut |_| {}).unwrap();
    assert!(matches!(v.blob(0, 9), Err(VaultError::NoSuchExpert { .. })));
}

fn flip(path: &std::path::Path, offset: u64) {
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    use std::os::unix::fs::FileExt;
    f.read_exact_at(&mut b, offset).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[b[0] ^ 0x40]).unwrap();
}

/// Replaces the manifest with `m`, appended at the end of the file, and rewrites the header to
/// point at it: what a hostile writer could do.
fn rewrite_manifest(path: &std::path::Path, m: &Manifest) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut hb = [0u8; header::HEADER_LEN];
    f.read_exact_at(&mut hb, 0).unwrap();
    let mut h = Header::decode(&hb).unwrap();
    let json = serde_json::to_vec(m).unwrap();
    h.manifest_offset = h.file_len.div_ceil(4096) * 4096;
    h.manifest_len = json.len() as u64;
    h.manifest_checksum = xxhash_rust::xxh3::xxh3_64(&json);
    h.file_len = h.manifest_offset + h.manifest_len;
    f.write_all_at(&json, h.manifest_offset).unwrap();
    f.write_all_at(&h.encode(), 0).unwrap();
}

#[test]
fn flipped_blob_byte_fails_verify_naming_the_blob() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    write_tiny(&path);
    let loc = Vault::open(&path).unwrap().blob(1, 2).unwrap();
    flip(&path, loc.offset + 100);
    let v = Vault::open(&path).unwrap();
    let err = v.verify(&mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("layer 1 expert 2"), "{err}");
}

#[test]
fn flipped_dense_byte_fails_verify_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    write_tiny(&path);
    let v = Vault::open(&path).unwrap();
    let off = v.header().dense_offset + v.dense("layers.0.attn.k").unwrap().offset;
    drop(v);
    flip(&path, off + 1);
    let err = Vault::open(&path).unwrap().verify(&mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("layers.0.attn.k"), "{err}");
}

#[test]
fn bad_headers_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    write_tiny(&path);
    let good = std::fs::read(&path).unwrap();

    let mut b = good.clone();
    b[0] = b'X';
    std::fs::write(&path, &b).unwrap();
    assert!(matches!(Vault::open(&path), Err(VaultError::BadMagic { .. })));

    let mut b = good.clone();
    b[8] = 2; // major version 2
    std::fs::write(&path, &b).unwrap();
    let e = Vault::open(&path).err().unwrap();
    assert!(matches!(e, VaultError::UnsupportedVersion { major: 2, .. }), "{e}");

    let mut b = good.clone();
    b[30] ^= 1; // a header field without fixing the checksum
    std::fs::write(&path, &b).unwrap();
    assert!(matches!(Vault::open(&path), Err(VaultError::Checksum { .. })));

    std::fs::write(&path, &good[..good.len() - 5000]).unwrap();
    let e = Vault::open(&path).err().unwrap();
    assert!(matches!(e, VaultError::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("truncated"));

    std::fs::write(&path, &good[..50]).unwrap();
    assert!(matches!(Vault::open(&path), Err(VaultError::Truncated { .. })));

    std::fs::write(&path, b"").unwrap();
    assert!(matches!(Vault::open(&path), Err(VaultError::Truncated { .. })));

    // A corrupted manifest byte is caught by the manifest checksum.
    std::fs::write(&path, &good).unwrap();
    let h = Vault::open(&path).unwrap().header().clone();
    flip(&path, h.manifest_offset + 10);
    assert!(matches!(Vault::open(&path), Err(VaultError::Checksum { .. })));
}

#[test]
fn unfinished_writer_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    {
        let mut w = VaultWriter::create(&path).unwrap();
        w.add_tensor("embed", Format::F32, &[2, 2], &[0u8; 16], "x").unwrap();
        assert!(w.tmp_path().exists());
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn manifest_inconsistent_with_architecture_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    let arch = tiny_arch();
    let mut w = VaultWriter::create(&path).unwrap();
    // Only the embedding: everything else is missing.
    w.add_tensor("embed", Format::F32, &[16, 32], &vec![0u8; 16 * 32 * 4], "x").unwrap();
    let parts: Vec<_> =
        names::EXPERT_PARTS.iter().zip(names::expert_part_shapes(&arch)).map(|(n, s)| (n.to_string(), Format::F32, s)).collect();
    let (parts, bs) = layout_blob(&parts, 4096).unwrap();
    w.begin_experts(parts.clone(), bs, &arch.moe_layers(), 4).unwrap();
    for l in 0..2 {
        for e in 0..4 {
            let d: Vec<Vec<u8>> = parts.iter().map(|p| vec![0; p.len as usize]).collect();
            w.add_blob(l, e, &d.iter().map(|x| x.as_slice()).collect::<Vec<_>>()).unwrap();
        }
    }
    w.finish(manifest(&arch)).unwrap();
    let e = Vault::open(&path).err().unwrap().to_string();
    assert!(e.contains("is missing"), "{e}");
}

/// Shapes whose byte count overflows are refused, never wrapped to a small length that a
/// hostile manifest could match.
#[test]
fn dense_lengths_never_wrap() {
    use crate::manifest::dense_len;
    assert_eq!(dense_len(Format::F32, &[16, 32]), Some(16 * 32 * 4));
    assert_eq!(dense_len(Format::Q8_0, &[3, 64]), Some(3 * 2 * 34));
    assert_eq!(dense_len(Format::F32, &[1 << 40, 1 << 30]), None);
    assert_eq!(dense_len(Format::F32, &[1 << 62, 1 << 62, 8]), None);
    assert_eq!(dense_len(Format::Q8_0, &[4, 33]), None);
    let dir = tempfile::tempdir().unwrap();
    let mut w = VaultWriter::create(&dir.path().join("m.smoe")).unwrap();
    let e = w.add_tensor("embed", Format::F32, &[1 << 40, 1 << 30], &[], "x").err().unwrap().to_string();
    assert!(e.contains("too large"), "{e}");
}

/// Layers whose expert formats differ: each layer's blobs take the size its own parts need (no
/// padding to the largest), layers unlike the first list their own parts, and the finished
/// manifest declares the features readers need (the writer's to declare, not each
/// converter's); a uniform model declares nothing. Blobs are found, read and verified at their
/// own offsets, and a manifest whose layer sizes do not add up to the region is refused.
#[test]
fn experts_by_layer_declare_their_feature() {
    use crate::manifest::{LAYER_BLOB_SIZES, LAYER_EXPERT_PARTS};
    let arch = tiny_arch();
    let shapes = names::expert_part_shapes(&arch);
    // (gate and up, down) of each layer.
    let specs = |(gu, down): (Format, Format)| -> Vec<(String, Format, [usize; 2])> {
        names::EXPERT_PARTS.iter().zip(shapes).map(|(n, s)| (n.to_string(), if *n == "down" { down } else { gu }, s)).collect()
    };
    let (b, f) = (Format::BF16, Format::F32);
    /// Each layer's (gate and up, down) formats, and the features the vault must declare.
    type Case = ([(Format, Format); 2], &'static [&'static str]);
    let cases: [Case; 4] = [
        // Layer 0 is 8 KiB a blob, layer 1 12 KiB; then the other way round.
        ([(b, b), (f, f)], &[LAYER_EXPERT_PARTS, LAYER_BLOB_SIZES]),
        ([(f, f), (b, b)], &[LAYER_EXPERT_PARTS, LAYER_BLOB_SIZES]),
        // Different parts of one size (6 and 8 KiB, both rounded to 8 KiB).
        ([(b, b), (b, f)], &[LAYER_EXPERT_PARTS]),
        ([(b, b), (b, b)], &[]),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (formats, features)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("m{i}.smoe"));
        let mut w = VaultWriter::create(&path).unwrap();
        for spec in names::dense_tensors(&arch) {
            let n: usize = spec.shape.iter().product();
            w.add_tensor(&spec.name, Format::F32, &spec.shape, &vec![0u8; n * 4], "src").unwrap();
        }
        let layers: Vec<_> = formats.iter().map(|&x| specs(x)).collect();
        assert!(w.begin_experts_by_layer(&layers[..1], &arch.moe_layers(), arch.moe.num_experts).is_err(), "one list per layer");
        let sizes: Vec<u64> = layers.iter().map(|l| layout_blob(l, 4096).unwrap().1).collect();
        let (blob, region) = w.begin_experts_by_layer(&layers, &arch.moe_layers(), arch.moe.num_experts).unwrap();
        assert_eq!(blob, *sizes.iter().max().unwrap());
        for (l, specs) in arch.moe_layers().into_iter().zip(&layers) {
            let (parts, _) = layout_blob(specs, 4096).unwrap();
            for e in 0..arch.moe.num_experts {
                let data: Vec<Vec<u8>> = parts.iter().map(|p| vec![(1 + l * 8 + e) as u8; p.len as usize]).collect();
                w.add_blob(l, e, &data.iter().map(|d| d.as_slice()).collect::<Vec<_>>()).unwrap();
            }
        }
        w.finish(manifest(&arch)).unwrap();
        let v = Vault::open(&path).unwrap();
        assert_eq!(v.manifest().required_features, features, "{formats:?}");
        let x = &v.manifest().experts;
        assert_eq!(x.blob_size, blob);
        let n = arch.moe.num_experts as u64;
        assert_eq!(v.header().experts_len, n * sizes.iter().sum::<u64>(), "no padding to the largest layer");
        assert_eq!(region, v.header().experts_len);
        let mut buf = vec![0u8; blob as usize];
        for (li, (l, (gu, down))) in arch.moe_layers().into_iter().zip(formats).enumerate() {
            let parts = x.layer_parts(l);
            assert_eq!((parts[0].format, parts[2].format), (gu, down), "layer {l}");
            assert_eq!(x.layer_blob_size(li), sizes[li]);
            for e in 0..arch.moe.num_experts {
                let loc = v.blob(l, e).unwrap();
                let start = v.header().experts_offset + n * sizes[..li].iter().sum::<u64>();
                assert_eq!((loc.offset, loc.len), (start + e as u64 * sizes[li], sizes[li]));
                v.read_blob(l, e, &mut buf).unwrap();
                assert!(buf[..parts[2].len as usize].iter().all(|&c| c == (1 + l * 8 + e) as u8), "layer {l} expert {e}");
            }
        }
        v.verify(&mut |_| {}).unwrap();
        // The last blob's last byte is the region's last: a flip there is found and named.
        if i == 0 {
            let loc = v.blob(1, 3).unwrap();
            drop(v);
            flip(&path, loc.offset + loc.len - 1);
            let e = Vault::open(&path).unwrap().verify(&mut |_| {}).err().unwrap().to_string();
            assert!(e.contains("layer 1 expert 3"), "{e}");
        }
    }
}

/// Per-layer blob sizes a reader must not trust: undeclared, larger than the largest, unaligned,
/// summing to another region size, or a largest size that is no layer's. (Sizes that hold are
/// read and verified in `experts_by_layer_declare_their_feature`.)
#[test]
fn hostile_layer_blob_sizes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    write_tiny(&path);
    let good = Vault::open(&path).unwrap().manifest().clone();
    let size = good.experts.blob_size;
    // (largest size, layer sizes, declared, the error wanted or "" for none)
    let cases: [(u64, [Option<u64>; 2], bool, &str); 7] = [
        (size, [Some(size), None], false, "without declaring the feature"),
        (size, [Some(size * 2), None], true, "not an aligned size"),
        (size, [Some(size - 512), None], true, "not an aligned size"),
        (size, [Some(0), None], true, "not an aligned size"),
        (size * 2, [Some(size), None], true, "blobs need"),
        // A largest size that is no layer's would size every reader's buffers: a huge one
        // must not reach an allocation.
        (size * 2, [Some(size), Some(size)], true, "is no layer's"),
        (1 << 62, [Some(size), Some(size)], true, "is no layer's"),
    ];
    for (largest, layers, declare, want) in cases {
        let mut m = good.clone();
        m.experts.blob_size = largest;
        for (l, b) in m.experts.layers.iter_mut().zip(layers) {
            l.blob_size = b;
        }
        if declare {
            m.required_features.push(crate::manifest::LAYER_BLOB_SIZES.into());
        }
        rewrite_manifest(&path, &m);
        match Vault::open(&path) {
            Ok(_) => panic!("{layers:?} was read"),
            Err(e) => assert!(e.to_string().contains(want), "{largest} {layers:?}: {e}"),
        }
    }
    // A part whose end does not fit 64 bits is misplaced, not wrapped into the blob.
    let mut m = good.clone();
    m.experts.parts[0].offset = u64::MAX - 8;
    rewrite_manifest(&path, &m);
    let e = Vault::open(&path).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("misplaced"), "{e}");
}
