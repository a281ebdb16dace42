//! `--device`: which backend runs a model (the CPU, or an NVIDIA GPU through smoe-cuda), and
//! opening a model on it for code that is generic over the backend.

use anyhow::{bail, Context, Result};
use smoe_engine::{Backend, Engine, OpenOptions, OpenReport};
use std::path::Path;
use std::sync::Arc;

/// Where a model runs, as given on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// A GPU when one is usable, else the CPU.
    Auto,
    /// The CPU backend.
    Cpu,
    /// NVIDIA GPU `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            t => match t.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!("unknown device '{s}' (use cpu, cuda, cuda:N or auto)")),
            },
        }
    }
}

/// The backend a model opens on, once chosen.
pub enum Chosen {
    /// The CPU.
    Cpu,
    /// A GPU, ready.
    Cuda(Box<smoe_cuda::CudaBackend>),
}

impl Device {
    /// Picks the backend and says which in one line (the startup line): an explicit `cuda`
    /// that cannot run is an error; `auto` falls back to the CPU and says why.
    pub fn choose(&self, opts: &smoe_cuda::CudaOptions) -> Result<(Chosen, String)> {
        let ordinal = match *self {
            Device::Cpu => return Ok((Chosen::Cpu, "device: cpu".into())),
            Device::Cuda(n) => n,
            Device::Auto => 0,
        };
        match smoe_cuda::CudaBackend::open(ordinal, opts) {
            Ok(b) => {
                let line = format!("device: {}", b.device());
                Ok((Chosen::Cuda(Box::new(b)), line))
            }
            Err(why) if *self == Device::Auto => Ok((Chosen::Cpu, format!("device: cpu (no usable GPU: {why})"))),
            Err(why) => bail!("--device cuda:{ordinal}: {why}"),
        }
    }
}

/// What a command does with an engine, on whichever backend it opened on.
pub trait OnEngine {
    /// The command's result.
    type Out;
    /// Runs the command.
    fn run<B: Backend + 'static>(self, engine: Engine<B>, report: OpenReport) -> Result<Self::Out>;
}

/// The VRAM expert tier's size from `--gpu-cache`: a number of experts becomes bytes at the
/// expert size of `model`; without one (serve: models differ) only a size is accepted.
pub fn cuda_options(
    gpu_cache: Option<smoe_engine::CacheSize>,
    misses: smoe_cuda::MissMode,
    model: Option<&Path>,
    precision: smoe_engine::Precision,
) -> Result<smoe_cuda::CudaOptions> {
    use smoe_engine::CacheSize;
    let expert_bytes = match (gpu_cache, model) {
        (None | Some(CacheSize::Auto) | Some(CacheSize::Resident), _) => None,
        (Some(CacheSize::Bytes(b)), _) => Some(b),
        (Some(CacheSize::Experts(n)), Some(path)) => {
            let sizes = smoe_engine::model_sizes(path).with_context(|| format!("open {}", path.display()))?;
            Some(n as u64 * sizes.slot_bytes)
        }
        (Some(CacheSize::Experts(_)), None) => bail!("--gpu-cache takes a size such as 20GiB here: models differ in expert size"),
    };
    Ok(smoe_cuda::CudaOptions { expert_bytes, misses, precision: Some(precision), ..Default::default() })
}

/// Opens `path` on the chosen backend and hands the engine to `then`.
pub fn open_on<W: OnEngine>(chosen: Chosen, path: &Path, opts: &OpenOptions, lookahead: bool, then: W) -> Result<W::Out> {
    let ctx = || format!("open {}", path.display());
    match chosen {
        Chosen::Cpu => ready(smoe_engine::open_cpu(path, opts).with_context(ctx)?, lookahead, then),
        Chosen::Cuda(b) => ready(smoe_engine::open(path, opts, *b).with_context(ctx)?, lookahead, then),
    }
}

/// An opened engine, whichever its backend: lookahead set, the open report said, `then` run.
fn ready<B: Backend + 'static, W: OnEngine>((mut engine, report): (Engine<B>, OpenReport), lookahead: bool, then: W) -> Result<W::Out> {
    engine.model.set_lookahead(lookahead);
    eprintln!("{report}");
    then.run(engine, report)
}

/// The server's models on a GPU: each opens on its own [`smoe_cuda::CudaBackend`] of the same
/// device. Chosen by `--device auto`, a model the GPU backend cannot run (DeepSeek-V4 for now)
/// opens on the CPU instead, and the log says why; with an explicit `--device cuda` it fails
/// to load with the reason.
pub struct CudaOpener {
    pub ordinal: usize,
    pub opts: smoe_cuda::CudaOptions,
    pub line: String,
    pub auto: bool,
}

impl smoe_server::Opener for CudaOpener {
    fn describe(&self) -> String {
        self.line.clone()
    }
    fn open(
        &self,
        name: &str,
        path: &Path,
        opts: &OpenOptions,
        limits: smoe_server::worker::WorkerLimits,
        metrics: Arc<smoe_server::metrics::Metrics>,
    ) -> Result<(smoe_server::worker::Worker, OpenReport), smoe_engine::EngineError> {
        let b = smoe_cuda::CudaBackend::open(self.ordinal, &self.opts).map_err(smoe_engine::EngineError::Backend)?;
        if self.auto {
            let sizes = smoe_engine::model_sizes(path)?;
            if let Some(why) = smoe_engine::backend_lacks(&sizes.arch, &sizes.formats, &b) {
                eprintln!("{name}: on the CPU ({why})");
                drop(b);
                return smoe_server::Opener::open(&smoe_server::CpuOpener, name, path, opts, limits, metrics);
            }
        }
        let (engine, report) = smoe_engine::open(path, opts, b)?;
        Ok((smoe_server::worker::Worker::spawn(name.to_string(), engine, limits, metrics), report))
    }
}
