//! Every expert in memory: the simplest [`ExpertSource`], and the reference the streaming store
//! is checked against.

use crate::{BlobLayout, ExpertBatch, ExpertSource, StoreError, StoreStats};
use smoe_vault::Vault;
use std::sync::Mutex;

/// All blobs of a vault, read once and verified.
pub struct ResidentExperts {
    layout: BlobLayout,
    data: Vec<u8>,
    /// Index of each decoder layer among the MoE layers.
    moe_index: Vec<Option<usize>>,
    num_experts: usize,
    stats: Mutex<StoreStats>,
}

impl ResidentExperts {
    /// Reads and verifies every blob of `vault`.
    pub fn load(vault: &Vault) -> Result<ResidentExperts, StoreError> {
        let layout = BlobLayout::of(vault);
        let arch = vault.architecture();
        let moe = arch.moe_layers();
        let n = arch.moe.num_experts;
        let mut data = vec![0u8; moe.len() * n * layout.blob_size];
        let mut moe_index = vec![None; arch.num_layers];
        for (i, &l) in moe.iter().enumerate() {
            moe_index[l] = Some(i);
            for e in 0..n {
                let off = (i * n + e) * layout.blob_size;
                vault.read_blob(l, e, &mut data[off..off + layout.blob_size]).map_err(|source| match source {
                    smoe_vault::VaultError::Checksum { .. } => StoreError::Checksum { layer: l, expert: e },
                    source => StoreError::Read { layer: l, expert: e, source },
                })?;
            }
        }
        let bytes_read = data.len() as u64;
        Ok(ResidentExperts { layout, data, moe_index, num_experts: n, stats: Mutex::new(StoreStats { bytes_read, ..Default::default() }) })
    }
}

impl ExpertSource for ResidentExperts {
    fn layout(&self) -> &BlobLayout {
        &self.layout
    }

    fn with_experts(&self, layer: usize, experts: &[u32], f: &mut dyn FnMut(&ExpertBatch<'_>)) -> Result<(), StoreError> {
        let li = self.moe_index.get(layer).copied().flatten();
        let mut batch = Vec::with_capacity(experts.len());
        for (i, &e) in experts.iter().enumerate() {
            let e = e as usize;
            let li = li.filter(|_| e < self.num_experts).ok_or(StoreError::NoSuchExpert { layer, expert: e })?;
            let off = (li * self.num_experts + e) * self.layout.blob_size;
            batch.push((i, self.layout.view(&self.data[off..off + self.layout.blob_size])));
        }
        f(&batch);
        self.stats.lock().unwrap().hits += experts.len() as u64;
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        *self.stats.lock().unwrap()
    }
}
