//! The streaming expert store under the engine: output bit-identical to a fully resident run at
//! any cache size, counters that agree, and read errors that fail one request cleanly.

mod common;
use common::*;
use smoe_engine::{score, CpuBackend, Model, Precision, ScoreMode};
use smoe_quant::Format;
use smoe_store::{ExpertSource, ExpertStore, ResidentExperts, StoreOptions};
use smoe_vault::Vault;
use std::path::Path;
use std::sync::Arc;

fn streaming(path: &Path, slots: usize) -> (Model<CpuBackend>, Arc<ExpertStore>) {
    streaming_with(path, &StoreOptions::with_slots(slots))
}

fn streaming_with(path: &Path, opts: &StoreOptions) -> (Model<CpuBackend>, Arc<ExpertStore>) {
    let v = Vault::open(path).unwrap();
    let store = Arc::new(ExpertStore::open(&v, opts).unwrap());
    let model = Model::load(&v, CpuBackend::new(Precision::Reference), store.clone()).unwrap();
    (model, store)
}

#[test]
fn any_cache_size_is_bit_identical_to_resident() {
    for name in ALL_FIXTURES {
        let path = vault(name, Format::Q8_0, Format::Q8_0);
        let v = Vault::open(&path).unwrap();
        let a = v.architecture().clone();
        let total = a.moe_layers().len() * a.moe.num_experts;
        let resident = Model::load(&v, CpuBackend::new(Precision::Reference), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
        let blob = v.manifest().experts.blob_size;
        for tag in ["chat", "long"] {
            let input = input_ids(name, tag);
            for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
                let want = score(&resident, &input, mode, 64, false).unwrap();
                for slots in [a.moe.top_k, total.div_ceil(10)] {
                    let (model, store) = streaming(&path, slots);
                    let got = score(&model, &input, mode, 64, false).unwrap();
                    assert!(got.logits == want.logits, "{name} {tag} {mode:?} with {slots} slots: logits differ");
                    for (l, r) in &want.routes {
                        assert_eq!(got.routes[l].experts, r.experts);
                        assert!(got.routes[l].weights == r.weights);
                    }
                    // Counters agree: every expert use is a hit or a miss; every miss is one blob read.
                    let s = store.stats();
                    let uses: u64 = match mode {
                        // Decode: each token uses k distinct experts per MoE layer.
                        ScoreMode::Decode => (input.len() * a.moe.top_k * a.moe_layers().len()) as u64,
                        // Prefill: each layer of each chunk fetches the union of its tokens' experts once.
                        ScoreMode::Prefill => {
                            let mut n = 0u64;
                            for r in want.routes.values() {
                                for chunk in r.experts.chunks(64 * a.moe.top_k) {
                                    let mut u: Vec<i32> = chunk.to_vec();
                                    u.sort();
                                    u.dedup();
                                    n += u.len() as u64;
                                }
                            }
                            n
                        }
                    };
                    assert_eq!(s.hits + s.misses, uses, "{name} {tag} {mode:?} {slots}");
                    assert_eq!(s.bytes_read, s.misses * blob, "{name} {tag} {mode:?} {slots}");
                    assert!(s.misses > 0);
                }
            }
        }
    }
}

#[test]
fn a_big_enough_cache_stops_reading() {
    let path = vault("qwen3_moe", Format::Q8_0, Format::Q8_0);
    let (model, store) = streaming(&path, 10_000);
    let input = input_ids("qwen3_moe", "long");
    let r = score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
    let first = store.stats();
    let distinct: usize = r
        .routes
        .values()
        .map(|l| {
            let mut e = l.experts.clone();
            e.sort();
            e.dedup();
            e.len()
        })
        .sum();
    assert_eq!(first.misses as usize, distinct, "each expert used is read exactly once");
    score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
    let second = store.stats().since(&first);
    assert_eq!(second.misses, 0, "the cache persists across requests");
}

/// A cache smaller than the routed experts prefills in longer chunks (each chunk reads what
/// it misses again); one that holds them all, or resident experts, keeps the backend's chunk.
#[test]
fn a_cache_smaller_than_the_experts_prefills_in_longer_chunks() {
    use smoe_engine::{PREFILL_CHUNK, STREAMING_PREFILL_CHUNK};
    let path = vault("qwen3_moe", Format::Q8_0, Format::Q8_0);
    let v = Vault::open(&path).unwrap();
    let total = v.architecture().moe_layers().len() * v.architecture().moe.num_experts;
    assert_eq!(streaming(&path, total / 2).0.prefill_chunk(), STREAMING_PREFILL_CHUNK);
    assert_eq!(streaming(&path, total).0.prefill_chunk(), PREFILL_CHUNK);
    let resident = Model::load(&v, CpuBackend::new(Precision::Reference), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    assert_eq!(resident.prefill_chunk(), PREFILL_CHUNK);
}

#[test]
fn injected_read_error_fails_one_request_and_the_engine_recovers() {
    let path = vault("mixtral", Format::Q8_0, Format::Q8_0);
    let input = input_ids("mixtral", "chat");
    let (reference, _) = streaming(&path, 4);
    let want = score(&reference, &input, ScoreMode::Decode, 64, false).unwrap();
    // A cold store must read the first token's layer-1 experts: make one of them fail.
    let (model, store) = streaming(&path, 4);
    let victim = want.routes[&1].experts[0] as usize;
    store.inject_read_error(1, victim);
    let want = want.logits;
    let e = score(&model, &input, ScoreMode::Decode, 64, false).unwrap_err().to_string();
    assert!(e.contains(&format!("expert {victim} of layer 1")) && e.contains("Input/output error"), "{e}");
    let again = score(&model, &input, ScoreMode::Decode, 64, false).unwrap().logits;
    assert!(again == want, "the next request is unaffected");
}

/// A prefetch whose read fails costs nothing but the read: the request that next reaps it is
/// not failed for an expert it may not need (it used to be), and the expert is read again when
/// a request does need it.
#[test]
fn a_failed_prefetch_fails_no_request() {
    let path = vault("mixtral", Format::Q8_0, Format::Q8_0);
    let input = input_ids("mixtral", "chat");
    let (reference, _) = streaming(&path, 4);
    let want = score(&reference, &input, ScoreMode::Decode, 64, false).unwrap();
    // A fixed depth: the measured one starts at 1, which leaves no room for prefetches.
    let opts = StoreOptions { queue_depth: smoe_store::depth::QueueDepth::Fixed(8), ..StoreOptions::with_slots(4) };
    let (model, store) = streaming_with(&path, &opts);
    let victim = want.routes[&1].experts[0] as usize;
    store.inject_read_error(1, victim);
    smoe_store::ExpertSource::prefetch(&*store, 1, &[victim as u32]);
    assert_eq!(store.stats().prefetch_issued, 1, "the prefetch was issued");
    let got = score(&model, &input, ScoreMode::Decode, 64, false).expect("a failed prefetch fails no request");
    assert!(got.logits == want.logits, "the expert was read again on demand");
    let s = store.stats();
    assert_eq!((s.prefetch_issued, s.prefetch_failed), (1, 1));
}

/// Forwards to a store and records what the model asked for, in order.
struct Recorder {
    store: Arc<ExpertStore>,
    calls: std::sync::Mutex<Vec<(usize, Vec<u32>)>>,
}

impl ExpertSource for Recorder {
    fn with_experts(
        &self,
        layer: usize,
        experts: &[u32],
        f: &mut dyn FnMut(&smoe_store::ExpertBatch<'_>),
    ) -> Result<(), smoe_store::StoreError> {
        self.calls.lock().unwrap().push((layer, experts.to_vec()));
        self.store.with_experts(layer, experts, f)
    }
    fn stats(&self) -> smoe_store::StoreStats {
        self.store.stats()
    }
}

/// EIO, a short read, and a file that ends early, injected into the I/O engine (io_uring and
/// the pread pool) at the first, second, a middle and the last expert read of a request: a
/// short read is resumed and changes no number; the others fail the request with an error
/// naming that read's layer and expert, never a panic or a computed answer; the same store
/// then serves the request again with the right logits.
#[test]
fn faults_at_the_nth_expert_read_name_the_expert_and_the_store_recovers() {
    use smoe_store::io::{Fault, IoKind};
    let path = vault("mixtral", Format::Q8_0, Format::Q8_0);
    let v = Vault::open(&path).unwrap();
    let a = v.architecture();
    let total = a.moe_layers().len() * a.moe.num_experts;
    let blob = v.manifest().experts.blob_size as usize;
    assert!(blob >= 2 * 4096, "a short read of 4096 bytes must leave some of a {blob}-byte blob");
    let input = input_ids("mixtral", "chat");
    let mut cases = 0;
    for mode in [ScoreMode::Decode, ScoreMode::Prefill] {
        // With a slot for every expert nothing is evicted, so the n-th read is of the n-th
        // expert first asked for.
        let rec = Arc::new(Recorder {
            store: Arc::new(ExpertStore::open(&v, &StoreOptions::with_slots(total)).unwrap()),
            calls: Default::default(),
        });
        let model = Model::load(&v, CpuBackend::new(Precision::Reference), rec.clone()).unwrap();
        let want = score(&model, &input, mode, 64, false).unwrap().logits;
        let mut order: Vec<(usize, u32)> = Vec::new();
        for (layer, experts) in rec.calls.lock().unwrap().iter() {
            for &e in experts {
                if !order.contains(&(*layer, e)) {
                    order.push((*layer, e));
                }
            }
        }
        assert_eq!(order.len() as u64, rec.stats().misses, "{mode:?}");
        for io in [IoKind::Auto, IoKind::Pool] {
            for n in [0, 1, order.len() / 2, order.len() - 1] {
                for fault in [Fault::Eio, Fault::Short { bytes: 4096 }, Fault::Truncated { bytes: 4096 }] {
                    let opts = StoreOptions { io, ..StoreOptions::with_slots(total) };
                    let store = Arc::new(ExpertStore::open(&v, &opts).unwrap());
                    let model = Model::load(&v, CpuBackend::new(Precision::Reference), store.clone()).unwrap();
                    store.inject_fault(n as u64, fault);
                    let got = score(&model, &input, mode, 64, false);
                    let (layer, expert) = order[n];
                    let what = format!("{mode:?} {io:?} read {n} ({fault:?})");
                    match fault {
                        Fault::Short { .. } => assert!(got.unwrap().logits == want, "{what}: a resumed short read changed the logits"),
                        _ => {
                            let e = got.err().unwrap_or_else(|| panic!("{what}: computed an answer")).to_string();
                            let cause = if fault == Fault::Eio { "Input/output error" } else { "read past the end of the file" };
                            assert!(e.contains(&format!("reading expert {expert} of layer {layer}")) && e.contains(cause), "{what}: {e}");
                        }
                    }
                    let again = score(&model, &input, mode, 64, false).unwrap_or_else(|e| panic!("{what}: after the fault: {e}"));
                    assert!(again.logits == want, "{what}: the next request differs");
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} faults injected, each followed by a healthy request");
}

#[test]
fn truncated_and_corrupted_vaults_are_reported_not_computed_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    std::fs::copy(vault("qwen3_moe", Format::Q8_0, Format::Q8_0), &path).unwrap();
    let original = std::fs::read(&path).unwrap();
    let (model, _store) = streaming(&path, 2);
    let input = input_ids("qwen3_moe", "chat");
    let want = score(&model, &input, ScoreMode::Prefill, 64, false).unwrap().logits;
    // Truncate after opening: the experts of the last layer are gone.
    let v = Vault::open(&path).unwrap();
    let cut = v.blob(3, 0).unwrap().offset;
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(cut).unwrap();
    let e = score(&model, &input, ScoreMode::Prefill, 64, false).unwrap_err().to_string();
    assert!(e.contains("of layer 3"), "{e}");
    std::fs::write(&path, &original).unwrap();
    assert!(score(&model, &input, ScoreMode::Prefill, 64, false).unwrap().logits == want);
    // Corrupt one blob: its checksum fails and it is never used.
    let loc = v.blob(2, 5).unwrap();
    let mut bad = original.clone();
    bad[loc.offset as usize + 100] ^= 0x55;
    std::fs::write(&path, &bad).unwrap();
    let (model2, _s2) = streaming(&path, 2);
    let e = score(&model2, &input, ScoreMode::Prefill, 64, false).unwrap_err().to_string();
    assert!(e.contains("expert 5 of layer 2 failed its checksum"), "{e}");
    // Loaded whole (`--cache resident`, read by several workers), the same blob is refused.
    let e = ResidentExperts::load(&Vault::open(&path).unwrap()).err().expect("a corrupt blob loaded").to_string();
    assert!(e.contains("expert 5 of layer 2 failed its checksum"), "{e}");
    std::fs::write(&path, &original).unwrap();
    assert!(score(&model2, &input, ScoreMode::Prefill, 64, false).unwrap().logits == want);
}

#[test]
fn lookahead_prefetch_changes_no_numbers() {
    let path = vault("deepseek_v3", Format::Q8_0, Format::Q8_0);
    let input = input_ids("deepseek_v3", "long");
    let (plain, _) = streaming(&path, 4);
    let want = score(&plain, &input, ScoreMode::Decode, 64, false).unwrap().logits;
    let (mut model, store) = streaming(&path, 4);
    model.set_lookahead(true);
    let got = score(&model, &input, ScoreMode::Decode, 64, false).unwrap().logits;
    assert!(got == want);
    let s = store.stats();
    assert!(s.prefetch_issued > 0 && s.prefetch_used > 0, "{s:?}");
    assert!(s.hits + s.misses == (input.len() * 2 * 2) as u64);
}

/// The fast path reads Q4_K, Q2_K, Q3_K (and, with AVX-512 VNNI, Q8_0) experts interleaved by
/// eight rows where the store lays them out so:
/// a streaming store through a small cache gives exactly the resident interleaved run's logits,
/// and both agree with plain rows up to float summation order (measured here for Q4_K: mean
/// |diff| 1e-8 to 4e-3 against the int8 path's own 1e-2 to 2e-2 from the f32 reference).
#[test]
fn interleaved_experts_match_plain_rows() {
    for (name, experts) in
        [("qwen3_moe_k", Format::Q4_K), ("qwen3_moe", Format::Q8_0), ("qwen3_moe_k", Format::Q2_K), ("qwen3_moe_k", Format::Q3_K)]
    {
        interleaved_experts_match(name, experts);
    }
}

fn interleaved_experts_match(name: &str, experts: Format) {
    use smoe_store::ExpertMap;
    let path = vault(name, experts, Format::Q8_0);
    let v = Vault::open(&path).unwrap();
    let map = ExpertMap::of_vault(&v).unwrap();
    let on = map.clone().interleaved(&[experts]);
    // Every expert matrix of these fixtures is in whole groups of eight rows.
    let mut slot = vec![0u8; on.slot_size()];
    on.interleave_slot(0, 0, &mut slot, &mut Vec::new());
    assert_eq!(on.view(0, 0, &slot, smoe_store::SlotHandle { slot: 0, load: 0 }).down.layout, smoe_quant::Layout::Interleaved8);
    let fast = |src: Arc<dyn ExpertSource>| Model::load(&v, CpuBackend::new(Precision::Fast), src).unwrap();
    let plain = fast(Arc::new(ResidentExperts::load_map(map).unwrap()));
    let resident = fast(Arc::new(ResidentExperts::load_map(on.clone()).unwrap()));
    let streamed = fast(Arc::new(ExpertStore::open_map(on, &StoreOptions::with_slots(v.architecture().moe.top_k)).unwrap()));
    let reference = Model::load(&v, CpuBackend::new(Precision::Reference), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    for tag in ["chat", "long"] {
        let input = input_ids(name, tag);
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let want = score(&plain, &input, mode, 64, false).unwrap();
            let a = score(&resident, &input, mode, 64, false).unwrap();
            let b = score(&streamed, &input, mode, 64, false).unwrap();
            assert!(a.logits == b.logits, "{tag} {mode:?}: streamed differs from resident");
            // Against plain rows only float summation order differs: both kernels round a
            // block's large, cancelling scale and minimum terms, and a difference that enters
            // the KV cache stays. It must stay well inside the int8 path's own error against
            // the f32 reference, and rarely change the top token.
            let r = score(&reference, &input, mode, 64, false).unwrap();
            let mean = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p - q).abs() as f64).sum::<f64>() / x.len() as f64;
            let (layout_err, int8_err) = (mean(&a.logits, &want.logits), mean(&want.logits, &r.logits));
            let vocab = want.logits.len() / input.len();
            let argmax = |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b });
            let same_top = (0..input.len())
                .filter(|&t| argmax(&want.logits[t * vocab..(t + 1) * vocab]) == argmax(&a.logits[t * vocab..(t + 1) * vocab]))
                .count();
            eprintln!(
                "{name} {tag} {mode:?}: interleaved vs rows {layout_err:.2e}, rows vs f32 reference {int8_err:.2e}; top-1 agrees at {same_top} of {}",
                input.len()
            );
            assert!(layout_err <= 0.5 * int8_err && same_top * 100 >= input.len() * 95, "{name} {tag} {mode:?}: interleaved vs rows");
        }
    }
}

/// The handles a backend would key its own copies of experts by: a hit hands back the slot and
/// load it was read into; an expert read again after eviction gets a new load; every slot
/// number lies inside the cache.
#[test]
fn slot_handles_name_the_slot_and_change_when_it_is_refilled() {
    let path = vault("qwen3_moe", Format::Q8_0, Format::Q8_0);
    let v = Vault::open(&path).unwrap();
    let n = v.architecture().moe.top_k;
    let store = ExpertStore::open(&v, &StoreOptions::with_slots(n)).unwrap();
    let handles = |experts: &[u32]| {
        let mut out = vec![None; experts.len()];
        store
            .with_experts(v.architecture().moe_layers()[0], experts, &mut |batch| batch.iter().for_each(|(i, e)| out[*i] = Some(e.slot)))
            .unwrap();
        out.into_iter().map(|h| h.expect("every expert handed over")).collect::<Vec<_>>()
    };
    let first: Vec<u32> = (0..n as u32).collect();
    let a = handles(&first);
    assert!(a.iter().all(|h| (h.slot as usize) < n), "{a:?}");
    assert_eq!(handles(&first), a, "hits keep their slot and load");
    // Other experts evict the first ones; reading them again fills slots anew.
    let other: Vec<u32> = (n as u32..2 * n as u32).collect();
    handles(&other);
    let again = handles(&first);
    for (x, y) in a.iter().zip(&again) {
        assert!(y.load > x.load, "a refilled slot has a new load: {x:?} then {y:?}");
    }
    // A store holding everything names each expert's own slot, loaded once.
    let resident = ResidentExperts::load(&v).unwrap();
    let mut seen = Vec::new();
    resident.with_experts(v.architecture().moe_layers()[0], &first, &mut |batch| seen.extend(batch.iter().map(|(_, e)| e.slot))).unwrap();
    seen.sort_by_key(|h| h.slot);
    seen.dedup();
    assert_eq!(seen.len(), n);
    assert!(seen.iter().all(|h| h.load == 0));
}

/// The cache resized while requests run, as the server's memory watch does: from another
/// thread, between layers, with lookahead prefetches in flight. Logits stay bit-identical to a
/// resident run; after a shrink the store holds at most the new size and its memory counts no
/// more; grown back, it fills again and stops reading.
#[test]
fn a_cache_resized_mid_run_changes_no_numbers() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let name = "deepseek_v3";
    let path = vault(name, Format::Q8_0, Format::Q8_0);
    let v = Vault::open(&path).unwrap();
    let a = v.architecture().clone();
    let (k, total) = (a.moe.top_k, a.moe_layers().len() * a.moe.num_experts);
    let resident = Model::load(&v, CpuBackend::new(Precision::Reference), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    let input = input_ids(name, "long");
    for mode in [ScoreMode::Decode, ScoreMode::Prefill] {
        let want = score(&resident, &input, mode, 16, false).unwrap().logits;
        let (mut model, store) = streaming(&path, total);
        model.set_lookahead(true);
        let (stop, resizes) = (AtomicBool::new(false), AtomicUsize::new(0));
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                let sizes = [k, total / 2, total, k + 1, 1];
                while !stop.load(Ordering::Relaxed) {
                    let want = sizes[resizes.load(Ordering::Relaxed) % sizes.len()];
                    let c = store.resize(want);
                    assert_eq!(c.slots, want.clamp(k, total), "{c:?}");
                    assert!(c.resident_slots <= c.slots, "{c:?}");
                    resizes.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
            });
            let got = score(&model, &input, mode, 16, false).unwrap().logits;
            stop.store(true, Ordering::Relaxed);
            got
        });
        assert!(got == want, "{mode:?}: logits differ with the cache resized {} times", resizes.load(Ordering::Relaxed));
        assert!(resizes.load(Ordering::Relaxed) > 2, "the resizes ran during the request");
        // Shrunk to the least: a whole request through it holds no more than that.
        let c = store.resize(0);
        assert_eq!((c.slots, c.max_slots), (k, total));
        assert!(c.resident_slots <= k);
        assert!(score(&model, &input, mode, 16, false).unwrap().logits == want, "{mode:?} at {k} slots");
        let c = store.capacity();
        assert!(c.resident_slots <= k && c.slots == k, "{c:?}");
        // Grown back to its size at opening: it fills, and a second pass reads nothing.
        assert_eq!(store.resize(usize::MAX).slots, total);
        assert!(score(&model, &input, mode, 16, false).unwrap().logits == want);
        let before = store.stats();
        assert!(score(&model, &input, mode, 16, false).unwrap().logits == want);
        assert_eq!(store.stats().since(&before).misses, 0, "{mode:?}: the regrown cache holds every expert used");
        assert!(store.capacity().resident_slots > k);
    }
}

/// The prefault hint faults the cache in before any read, and the pages it faulted count as
/// held (the server's memory watch compares them with what memory went); numbers stay those of
/// a resident run.
#[cfg(target_os = "linux")]
#[test]
fn a_prefaulted_cache_counts_as_held_and_changes_no_numbers() {
    let path = vault("qwen3_moe", Format::Q8_0, Format::Q8_0);
    let (model, store) = streaming(&path, 10_000);
    let cap = store.cache_capacity().unwrap();
    assert_eq!(cap.resident_slots, 0, "nothing read or faulted yet");
    store.prefault_cache();
    let t = std::time::Instant::now();
    while store.cache_capacity().unwrap().resident_slots < cap.slots && t.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(store.cache_capacity().unwrap().resident_slots, cap.slots, "every slot faulted in counts as held");
    assert_eq!(store.stats().misses, 0, "faulting pages in reads no expert");
    let input = input_ids("qwen3_moe", "long");
    let v = Vault::open(&path).unwrap();
    let resident = Model::load(&v, CpuBackend::new(Precision::Reference), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    let (a, b) =
        (score(&model, &input, ScoreMode::Decode, 64, false).unwrap(), score(&resident, &input, ScoreMode::Decode, 64, false).unwrap());
    assert_eq!(a.logits, b.logits, "the same numbers as resident experts");
}
