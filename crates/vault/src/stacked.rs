//! Experts stored stacked: one tensor per part holding every expert's matrix after another
//! (how GGUF files store them). The store reads such a layout in place.

use smoe_quant::Format;

/// One stacked expert tensor: every expert's `[rows, cols]` matrix, one after the other.
#[derive(Clone, Debug)]
pub struct StackedPart {
    /// File of the split set.
    pub file: usize,
    /// Offset of expert 0.
    pub offset: u64,
    /// Bytes per expert.
    pub bytes: u64,
    /// Format.
    pub format: Format,
    /// Rows per expert.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}
