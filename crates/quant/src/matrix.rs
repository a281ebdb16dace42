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
    /// How the rows are laid out in `data`.
    pub layout: Layout,
}

/// How a matrix's rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Layout {
    /// One row after another (every file's layout).
    #[default]
    Rows,
    /// Rows of a block format (Q4_K, Q8_0, Q2_K, Q3_K) interleaved in groups of eight, in
    /// memory only ([`crate::interleave`]).
    Interleaved8,
}

impl<'a> QMatrix<'a> {
    /// Checks that `data` holds exactly `rows` rows.
    pub fn new(format: Format, rows: usize, cols: usize, data: &'a [u8]) -> Result<QMatrix<'a>, QuantError> {
        let expected = format.row_bytes(cols)? * rows;
        if data.len() != expected {
            return Err(QuantError::BufferSize { expected, got: data.len() });
        }
        Ok(QMatrix { format, rows, cols, data, layout: Layout::Rows })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The encoded bytes of row `r` (row layout only: an interleaved row is not contiguous).
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert_eq!(self.layout, Layout::Rows, "row bytes of an interleaved matrix");
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `[start, start + n)` as a matrix of their own (whole groups when interleaved).
    pub fn slice_rows(&self, start: usize, n: usize) -> QMatrix<'a> {
        let rb = self.row_bytes();
        if self.layout == Layout::Interleaved8 {
            assert!(start.is_multiple_of(crate::interleave::ROWS) && n.is_multiple_of(crate::interleave::ROWS), "slice of part of a group");
        }
        QMatrix { data: &self.data[start * rb..(start + n) * rb], rows: n, ..*self }
    }

    /// Decodes row `r` into `out` (`cols` long), in either layout.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        // Sizes were checked in `new`; a mismatch here is a caller bug.
        match self.layout {
            Layout::Rows => dequantize(self.format, self.row(r), out),
            Layout::Interleaved8 => {
                let mut row = vec![0u8; self.row_bytes()];
                crate::interleave::row(self.format, self.data, self.cols, r, &mut row);
                dequantize(self.format, &row, out)
            }
        }
        .expect("row size checked at construction");
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
