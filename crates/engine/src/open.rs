//! Opening a vault as a ready-to-run engine: the dense weights on the backend, the routed
//! experts behind a streaming store sized to the machine (or all resident).

use crate::cpu::{CpuBackend, Precision};
use crate::{Backend, Engine, EngineError, Model};
use smoe_quant::Format;
use smoe_store::policy::PolicyKind;
use smoe_store::{auto_cache_bytes, ExpertMap, ExpertSource, ExpertStore, ResidentExperts, StoreOptions};
use smoe_vault::{Manifest, Vault};
use std::path::Path;
use std::sync::Arc;

/// How big the expert cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSize {
    /// From available memory (MemAvailable, cgroup limits) minus dense weights, KV cache and a
    /// reserve.
    Auto,
    /// This many bytes.
    Bytes(u64),
    /// This many experts.
    Experts(usize),
    /// Every expert read into memory at start (no streaming).
    Resident,
}

impl std::str::FromStr for CacheSize {
    type Err = String;
    /// `auto`, `resident`, `N` experts (`512`), or a size (`8GiB`, `500MiB`, `2G`).
    fn from_str(s: &str) -> Result<CacheSize, String> {
        let t = s.trim();
        match t.to_ascii_lowercase().as_str() {
            "auto" => return Ok(CacheSize::Auto),
            "resident" | "all" => return Ok(CacheSize::Resident),
            _ => {}
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let v: f64 = num.parse().map_err(|_| format!("bad cache size '{s}'"))?;
        let mult = match unit.trim().to_ascii_lowercase().as_str() {
            "" => return Ok(CacheSize::Experts(v as usize)),
            "b" => 1.0,
            "k" | "kb" | "kib" => 1024.0,
            "m" | "mb" | "mib" => 1024.0 * 1024.0,
            "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
            "t" | "tb" | "tib" => 1024.0f64.powi(4),
            u => return Err(format!("bad cache size unit '{u}' in '{s}' (use MiB, GiB, or a number of experts)")),
        };
        Ok(CacheSize::Bytes((v * mult) as u64))
    }
}

/// How to open a model.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Arithmetic of the CPU backend.
    pub precision: Precision,
    /// Expert cache size.
    pub cache: CacheSize,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Verify blob checksums as they are read.
    pub verify: bool,
    /// Reads in flight at most: fixed, or measured (`auto`, the default).
    pub queue_depth: smoe_store::depth::QueueDepth,
    /// Compute threads (default: every core).
    pub threads: Option<usize>,
    /// Context limit in tokens; `None` picks [`default_context`]. The KV cache for this many
    /// tokens is reserved when the expert cache is sized automatically.
    pub ctx: Option<usize>,
    /// A chat template (Jinja source) used instead of the one the model ships (llama.cpp's
    /// `--chat-template-file`): for a model whose template is missing, wrong, or not the
    /// variant wanted (a thinking variant, say).
    pub chat_template: Option<String>,
    /// How the KV cache stores its rows ([`Model::set_kv_type`](crate::Model::set_kv_type);
    /// [`KvType::Auto`](crate::KvType::Auto) is f32 under [`Precision::Reference`]).
    pub kv_type: crate::KvType,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            precision: Precision::Reference,
            cache: CacheSize::Auto,
            policy: PolicyKind::ReuseDistance,
            verify: true,
            queue_depth: smoe_store::depth::QueueDepth::AUTO,
            threads: None,
            ctx: None,
            chat_template: None,
            kv_type: crate::KvType::F32,
        }
    }
}

/// What was chosen at open, for the start-up report.
#[derive(Clone, Debug)]
pub struct OpenReport {
    /// Experts the cache holds.
    pub cache_experts: usize,
    /// Bytes of the cache.
    pub cache_bytes: u64,
    /// Experts in the vault.
    pub total_experts: usize,
    /// Bytes of one expert blob.
    pub blob_bytes: u64,
    /// Bytes of the matrices of one expert in every MoE layer (top-k times this is what a
    /// token's experts read; layers of a mixed file differ, so not blob size times layers).
    pub expert_bytes_all_layers: u64,
    /// Why this size.
    pub reason: String,
    /// I/O engine.
    pub io: String,
    /// The context limit chosen.
    pub ctx: usize,
    /// How the KV cache stores its rows ([`KvType::Auto`](crate::KvType::Auto) made definite).
    pub kv_type: crate::KvType,
}

impl std::fmt::Display for OpenReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "expert cache: {} of {} experts ({:.1}%), {:.2} GiB ({}); {}; context {} tokens, KV cache {}",
            self.cache_experts,
            self.total_experts,
            100.0 * self.cache_experts as f64 / self.total_experts.max(1) as f64,
            self.cache_bytes as f64 / (1u64 << 30) as f64,
            self.reason,
            self.io,
            self.ctx,
            self.kv_type
        )
    }
}

/// The default context limit: the model's `max_position_embeddings`, capped so that a full
/// KV cache stored as `kv` takes at most an eighth of the memory available now (at least 2048
/// tokens).
pub fn default_context(arch: &smoe_vault::Architecture, kv: crate::KvType) -> usize {
    let per_token = crate::kv_bytes(arch, kv).0.max(1) as u64;
    let cap = (smoe_store::available_memory().available / 8 / per_token).max(2048);
    arch.max_position_embeddings.min(cap as usize)
}

/// A model file: a vault, or a GGUF read in place.
enum ModelFile {
    Vault(Box<Vault>),
    Gguf(Box<smoe_formats::gguf::GgufModel>),
}

/// Whether `path` starts with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

impl ModelFile {
    fn open(path: &Path) -> Result<ModelFile, EngineError> {
        if is_gguf(path) {
            let g = smoe_formats::gguf::GgufModel::open(path).map_err(|e| EngineError::Model(format!("{}: {e}", path.display())))?;
            return Ok(ModelFile::Gguf(Box::new(g)));
        }
        Ok(ModelFile::Vault(Box::new(Vault::open(path)?)))
    }

    fn architecture(&self) -> &smoe_vault::Architecture {
        match self {
            ModelFile::Vault(v) => v.architecture(),
            ModelFile::Gguf(g) => &g.arch,
        }
    }

    fn expert_map(&self) -> Result<ExpertMap, EngineError> {
        match self {
            ModelFile::Vault(v) => Ok(ExpertMap::of_vault(v)?),
            ModelFile::Gguf(g) => ExpertMap::stacked(g.gguf.paths.clone(), g.arch.moe_layers(), g.arch.moe.num_experts, &g.experts)
                .map_err(|e| EngineError::Model(e.to_string())),
        }
    }

    fn dense_len(&self) -> u64 {
        match self {
            ModelFile::Vault(v) => v.header().dense_len,
            ModelFile::Gguf(g) => g.dense.iter().map(|d| d.bytes()).sum(),
        }
    }

    /// The manifest and the dense tensors in memory.
    fn load_dense(&self) -> Result<(Manifest, Vec<u8>), EngineError> {
        match self {
            ModelFile::Vault(v) => Ok((v.manifest().clone(), v.read_dense_region()?)),
            ModelFile::Gguf(g) => {
                let (dense, region) = g.dense_region(&smoe_formats::Silent).map_err(|e| EngineError::Model(e.to_string()))?;
                let mut m = g.manifest();
                m.dense = dense;
                Ok((m, region))
            }
        }
    }
}

/// What a model file needs, read from its metadata alone.
#[derive(Clone, Debug)]
pub struct ModelSizes {
    /// The architecture.
    pub arch: smoe_vault::Architecture,
    /// Bytes of dense weights.
    pub dense_bytes: u64,
    /// Bytes of one cache slot (one expert).
    pub slot_bytes: u64,
    /// Experts in all MoE layers.
    pub total_experts: usize,
    /// The storage formats of its weights, dense and routed experts, each once.
    pub formats: Vec<Format>,
}

/// The storage formats of `file`'s weights (dense ones and the routed experts of `map`), each
/// once: what a backend is asked whether it can read ([`crate::backend_lacks`]).
fn weight_formats(file: &ModelFile, map: &ExpertMap) -> Vec<Format> {
    let dense: Vec<Format> = match file {
        ModelFile::Vault(v) => v.manifest().dense.iter().map(|d| d.format).collect(),
        ModelFile::Gguf(g) => g.dense.iter().map(|d| d.format).collect(),
    };
    let mut formats: Vec<_> = dense.into_iter().chain(map.layers.iter().flat_map(|l| l.parts.iter().map(|p| p.format))).collect();
    formats.sort_by_key(|f| *f as u32);
    formats.dedup();
    formats
}

/// Sizes of a vault or GGUF, without loading it.
pub fn model_sizes(path: &Path) -> Result<ModelSizes, EngineError> {
    let file = ModelFile::open(path)?;
    let map = file.expert_map()?;
    Ok(ModelSizes {
        arch: file.architecture().clone(),
        dense_bytes: file.dense_len(),
        slot_bytes: map.slot_size() as u64,
        total_experts: map.total_experts(),
        formats: weight_formats(&file, &map),
    })
}

/// Opens `path` (a vault, or a GGUF run in place) on the CPU backend: [`open`] with a
/// [`CpuBackend`] of `opts.precision` and `opts.threads`.
pub fn open_cpu(path: &Path, opts: &OpenOptions) -> Result<(Engine<CpuBackend>, OpenReport), EngineError> {
    let backend = match opts.threads {
        Some(n) => CpuBackend::with_threads(opts.precision, n.max(1)),
        None => CpuBackend::new(opts.precision),
    };
    open(path, opts, backend)
}

/// The formats a streaming store interleaves as experts land ([`ExpertMap::interleaved`]): what
/// the backend reads so when the cache holds every expert (each is read once), else none.
/// Interleaving is a read and a write of the whole expert on one core (~10-15 GB/s) on every
/// miss, and on the 2-core EPYC it cost more than the group kernels then saved (12-layer cuts,
/// a quarter of the experts cached, 2 threads; docs/benchmarks.md): Q2_K/Q3_K 235B shape with
/// the trace's routing 118-122 ms/token against 107-114 in rows; Q4_K 30B shape 59.3-63.7
/// against 54.9-60.1, and with the router's routing (hit rate 0.98) no better either.
/// Decided at open: a cache that holds every expert and is shrunk later (a server under
/// memory pressure, `resize_cache`) keeps interleaving what it reads again.
fn streamed_interleave(formats: Vec<Format>, holds_all: bool) -> Vec<Format> {
    if holds_all {
        formats
    } else {
        Vec::new()
    }
}

/// Opens `path` (a vault, or a GGUF run in place) on `backend`: the dense weights on the
/// backend, the routed experts behind a store sized by `opts.cache`.
pub fn open<B: Backend>(path: &Path, opts: &OpenOptions, backend: B) -> Result<(Engine<B>, OpenReport), EngineError> {
    let file = ModelFile::open(path)?;
    let arch = file.architecture().clone();
    let kv_type = opts.kv_type.resolve(&arch, &backend);
    let ctx = opts.ctx.unwrap_or_else(|| default_context(&arch, kv_type));
    let map = file.expert_map()?;
    // Refused before any weight is read: the routed experts' formats are known only here.
    if let Some(why) = crate::backend_lacks(&arch, &weight_formats(&file, &map), &backend) {
        return Err(EngineError::Model(format!("{why}; run it on the CPU (--device cpu)")));
    }
    if let Some(why) = crate::model::kv_type_refusal(&arch, kv_type, backend.kv_f16()) {
        return Err(EngineError::Input(why));
    }
    let total = map.total_experts();
    let blob = map.slot_size() as u64;
    let expert_bytes_all_layers = (0..arch.moe_layers().len()).map(|ord| map.expert_bytes(ord)).sum();
    let where_from = if matches!(file, ModelFile::Gguf(_)) { "; experts read in place from the GGUF" } else { "" };
    let (experts, report): (Arc<dyn ExpertSource>, OpenReport) = if opts.cache == CacheSize::Resident {
        let r = ResidentExperts::load_map(map.interleaved(&backend.interleaved_expert_formats()))?;
        let rep = OpenReport {
            cache_experts: total,
            cache_bytes: total as u64 * blob,
            total_experts: total,
            blob_bytes: blob,
            expert_bytes_all_layers,
            reason: "resident".into(),
            io: format!("read at start{where_from}"),
            ctx,
            kv_type,
        };
        (Arc::new(r), rep)
    } else {
        let (slots, reason) = match opts.cache {
            CacheSize::Experts(n) => (n, "--cache-experts".to_string()),
            CacheSize::Bytes(b) => ((b / blob) as usize, format!("{} MiB requested", b >> 20)),
            _ => {
                let (per_token, fixed) = crate::kv_bytes(&arch, kv_type);
                let kv = (per_token * ctx + fixed) as u64;
                let (bytes, why) = auto_cache_bytes(file.dense_len(), kv);
                ((bytes / blob) as usize, format!("auto: {why}"))
            }
        };
        let store = ExpertStore::open_map(
            map.interleaved(&streamed_interleave(backend.interleaved_expert_formats(), slots >= total)),
            &StoreOptions {
                slots,
                policy: opts.policy,
                queue_depth: opts.queue_depth,
                io: smoe_store::io::IoKind::Auto,
                verify: opts.verify,
                min_slots: arch.moe.top_k,
            },
        )?;
        let rep = OpenReport {
            cache_experts: store.slots(),
            cache_bytes: store.cache_bytes(),
            total_experts: total,
            blob_bytes: blob,
            expert_bytes_all_layers,
            reason,
            io: format!("{}{where_from}", store.io_description()),
            ctx,
            kv_type,
        };
        (Arc::new(store), rep)
    };
    let (mut manifest, region) = file.load_dense()?;
    if let Some(src) = &opts.chat_template {
        manifest.text.chat_template = Some(src.clone());
    }
    // Once the dense weights are in: the hint is that the model is ready. (On the 2-core VM,
    // which backs fresh memory slowly, the load was slower with the thread running either way;
    // docs/benchmarks.md.)
    let cache = experts.clone();
    let mut model = Model::load_parts(&arch, &manifest.dense, region, backend, experts)?;
    model.set_kv_type(kv_type).map_err(EngineError::Input)?;
    cache.prefault_cache();
    let mut engine = Engine::from_manifest(&manifest, model)?;
    engine.ctx = ctx;
    Ok((engine, report))
}
