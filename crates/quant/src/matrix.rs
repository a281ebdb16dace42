//! A borrowed view of a row-major matrix stored in any [`Format`].

use crate::{dequantize, Format, QuantError};

/// `rows` rows of `cols` elements, each row `format.row_bytes(cols)` bytes, contiguous.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    /// Storage format.
    pub format: Format,
    /// Number of rows (outputs).
    pub rows: usize,
    /// Row length (inputs).
    pub cols: usize,
    /// `rows * row_bytes` bytes.
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows.
    pub fn new(format: Format, rows: usize, cols: usize, data: &'a [u8]) -> Result<QMatrix<'a>, QuantError> {
        let expected = format.row_bytes(cols)? * rows;
        if data.len() != expected {
            return Err(QuantError::BufferSize { expected, got: data.len() });
        }
        Ok(QMatrix { format, rows, cols, data })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The encoded bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `[start, start + n)` as a matrix of their own.
    pub fn slice_rows(&self, start: usize, n: usize) -> QMatrix<'a> {
        let rb = self.row_bytes();
        QMatrix { format: self.format, rows: n, cols: self.cols, data: &self.data[start * rb..(start + n) * rb] }
    }

    /// Decodes row `r` into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        // Sizes were checked in `new`; a mismatch here is a caller bug.
        dequantize(self.format, self.row(r), out).expect("row size checked at construction");
    }

    /// Decodes the whole matrix.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}
