//! Opening a vault as a ready-to-run engine.

use crate::cpu::{CpuBackend, Precision};
use crate::{Engine, EngineError, Model};
use smoe_store::{ExpertSource, ResidentExperts};
use smoe_vault::Vault;
use std::path::Path;
use std::sync::Arc;

/// How to open a model.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Arithmetic of the CPU backend.
    pub precision: Precision,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            precision: Precision::Reference,
        }
    }
}

/// Opens `path` on the CPU backend with all experts resident.
pub fn open_cpu(path: &Path, opts: &OpenOptions) -> Result<Engine<CpuBackend>, EngineError> {
    let vault = Vault::open(path)?;
    let experts: Arc<dyn ExpertSource> = Arc::new(ResidentExperts::load(&vault)?);
    let model = Model::load(&vault, CpuBackend::new(opts.precision), experts)?;
    Engine::new(&vault, model)
}
