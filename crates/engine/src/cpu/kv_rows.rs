//! The rows of one KV cache layer's keys or values: f32, or IEEE half floats
//! ([`KvShape::f16`](crate::backend::KvShape::f16)).
//!
//! Half-float rows are rounded to nearest even as they are stored and widened exactly when
//! read, so every reader computes what it would over an f32 cache holding the rounded values:
//! the fast path's kernels widen them as they load them, the reference path a row at a time
//! into scratch, which keeps prefill, decode and batched steps bit for bit alike.

/// One layer's keys or values, row-major.
pub(crate) enum KvRows {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl KvRows {
    pub(crate) fn new(f16: bool) -> KvRows {
        KvRows::from_f32(Vec::new(), f16)
    }

    /// `values` as rows of the kind `f16` says (rounded to nearest even for f16).
    pub(crate) fn from_f32(values: Vec<f32>, f16: bool) -> KvRows {
        if f16 {
            KvRows::F16(values.iter().map(|&v| smoe_quant::half::f32_to_f16_bits(v)).collect())
        } else {
            KvRows::F32(values)
        }
    }

    /// Values held.
    pub(crate) fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values there is room for without growing.
    pub(crate) fn capacity(&self) -> usize {
        match self {
            KvRows::F32(v) => v.capacity(),
            KvRows::F16(v) => v.capacity(),
        }
    }

    /// Bytes of the values held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len() * 4,
            KvRows::F16(v) => v.len() * 2,
        }
    }

    pub(crate) fn reserve_exact(&mut self, more: usize) {
        match self {
            KvRows::F32(v) => v.reserve_exact(more),
            KvRows::F16(v) => v.reserve_exact(more),
        }
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        match self {
            KvRows::F32(v) => v.truncate(len),
            KvRows::F16(v) => v.truncate(len),
        }
    }

    pub(crate) fn shrink_to_fit(&mut self) {
        match self {
            KvRows::F32(v) => v.shrink_to_fit(),
            KvRows::F16(v) => v.shrink_to_fit(),
        }
    }

    pub(crate) fn clear(&mut self) {
        self.truncate(0);
    }

    /// Drops the first `n` values.
    pub(crate) fn drop_front(&mut self, n: usize) {
        match self {
            KvRows::F32(v) => drop(v.drain(..n)),
            KvRows::F16(v) => drop(v.drain(..n)),
        }
    }

    /// Replaces the contents with `src`'s first `n` values (same kind: both layers come from
    /// one shape).
    pub(crate) fn copy_prefix(&mut self, src: &KvRows, n: usize) {
        match (self, src) {
            (KvRows::F32(d), KvRows::F32(s)) => {
                d.clear();
                d.extend_from_slice(&s[..n]);
            }
            (KvRows::F16(d), KvRows::F16(s)) => {
                d.clear();
                d.extend_from_slice(&s[..n]);
            }
            _ => panic!("KV copy between an f32 and an f16 layer"),
        }
    }

    /// Empties the rows and makes them of the kind `f16` says.
    pub(crate) fn reset(&mut self, f16: bool) {
        if matches!(self, KvRows::F16(_)) == f16 {
            self.clear();
        } else {
            *self = KvRows::new(f16);
        }
    }

    /// Appends `src`'s values `at..at + len` as they are stored (same kind).
    pub(crate) fn push_from(&mut self, src: &KvRows, at: usize, len: usize) {
        match (self, src) {
            (KvRows::F32(d), KvRows::F32(s)) => d.extend_from_slice(&s[at..at + len]),
            (KvRows::F16(d), KvRows::F16(s)) => d.extend_from_slice(&s[at..at + len]),
            _ => panic!("KV gather between an f32 and an f16 layer"),
        }
    }

    /// The values as f32, for the readers that only ever see f32 layers (DeepSeek-V4's
    /// compressed caches, the lightning indexer's keys: [`KvShape::f16`] is never set on them).
    ///
    /// [`KvShape::f16`]: crate::backend::KvShape::f16
    pub(crate) fn f32s(&self) -> &Vec<f32> {
        match self {
            KvRows::F32(v) => v,
            KvRows::F16(_) => panic!("this KV layer is f16; its reader takes f32 rows only"),
        }
    }

    /// See [`KvRows::f32s`].
    pub(crate) fn f32s_mut(&mut self) -> &mut Vec<f32> {
        match self {
            KvRows::F32(v) => v,
            KvRows::F16(_) => panic!("this KV layer is f16; its writer takes f32 rows only"),
        }
    }

    /// `n` rows of `len` values, `stride` apart from value `at`, as f32 rows and their
    /// stride: the rows themselves for an f32 layer, widened into `buf` (`len` apart) for an
    /// f16 one.
    pub(crate) fn rows<'a>(
        &'a self,
        at: usize,
        n: usize,
        len: usize,
        stride: usize,
        buf: &'a mut Vec<f32>,
        k: &smoe_kernels::Kernels,
    ) -> (&'a [f32], usize) {
        match self {
            KvRows::F32(v) => (&v[at..], stride),
            KvRows::F16(v) => {
                buf.resize(n * len, 0.0);
                k.f16_rows_to_f32(&v[at..], n, len, stride, buf);
                (&buf[..], len)
            }
        }
    }
}

impl From<Vec<f32>> for KvRows {
    fn from(v: Vec<f32>) -> KvRows {
        KvRows::F32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 rows hold the values rounded to nearest even and give them back exactly, in any
    /// stride; dropping and copying keep what they hold.
    #[test]
    fn f16_rows_round_once_and_read_back_exactly() {
        let k = smoe_kernels::best();
        let round = |x: f32| smoe_quant::half::f16_bits_to_f32(smoe_quant::half::f32_to_f16_bits(x));
        let src: Vec<f32> = (0..24).map(|i| (i as f32 * 0.377).sin() * 3.0 + 1e-4).collect();
        let mut rows = KvRows::from_f32(src.clone(), true);
        assert_eq!((rows.len(), rows.bytes()), (24, 48));
        let mut buf = Vec::new();
        let (got, stride) = rows.rows(0, 2, 6, 12, &mut buf, k);
        assert_eq!(stride, 6);
        let want: Vec<f32> = src[..6].iter().chain(&src[12..18]).map(|&x| round(x)).collect();
        assert!(got[..12].iter().zip(&want).all(|(g, &w)| g.to_bits() == w.to_bits()), "{got:?} vs {want:?}");
        let mut copy = KvRows::new(true);
        copy.copy_prefix(&rows, 12);
        rows.drop_front(6);
        let a = rows.rows(0, 1, 6, 6, &mut buf, k).0[..6].to_vec();
        let mut buf2 = Vec::new();
        assert_eq!(a, copy.rows(6, 1, 6, 6, &mut buf2, k).0[..6]);
    }
}
