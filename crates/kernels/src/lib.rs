/*!
Quantized dot products for smoe's CPU backend.

Decode is a matrix-vector product per weight matrix, bound by memory bandwidth; prefill is a
matrix-matrix product, bound by arithmetic. Both reduce to dot products of one stored weight row
with one activation row. Activations are quantized to int8 blocks once per row ([`act`]) so the
inner loops are integer; each weight format has a scalar reference ([`scalar`]) and, where it
matters, SIMD versions for AVX-512 VNNI, AVX2 and NEON, chosen once at run time ([`best`]).

This crate owns the arithmetic only: formats and their decoders are `smoe-quant`'s, threading
and buffers the engine's.
*/
#![deny(missing_docs)]

pub mod act;
pub mod arena;
#[cfg(target_arch = "aarch64")]
pub mod arm;
pub mod attn;
pub mod gemm;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
pub mod x86;

pub use arena::{ActArena, ArenaPart, QuantAct, QuantRows};

use act::{ActKind, Block256, Block32};
use smoe_quant::Format;
use std::sync::OnceLock;

/// A dot product of one weight row (raw bytes of its format) with one activation row.
///
/// The functions are `unsafe` because SIMD versions need CPU features; a [`Kernels`] table only
/// ever holds functions its CPU supports.
#[derive(Clone, Copy)]
pub enum DotFn {
    /// Against f32 activations.
    F32(unsafe fn(&[u8], &[f32]) -> f32),
    /// Against 32-element int8 blocks.
    Q32(unsafe fn(&[u8], &[Block32]) -> f32),
    /// Against 256-element int8 super-blocks.
    Q256(unsafe fn(&[u8], &[Block256]) -> f32),
}

/// An activation row in whichever form a weight format needs.
#[derive(Clone, Copy)]
pub enum ActRow<'a> {
    /// Plain f32.
    F32(&'a [f32]),
    /// 32-element blocks.
    Q32(&'a [Block32]),
    /// 256-element super-blocks.
    Q256(&'a [Block256]),
}

/// Which activation form `f` needs.
pub fn act_kind(f: Format) -> ActKind {
    match f {
        Format::F32 | Format::F16 | Format::BF16 => ActKind::F32,
        Format::Q8_0 | Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 | Format::MXFP4 | Format::MXFP8 | Format::FP8 => {
            ActKind::Q8x32
        }
        Format::Q2_K | Format::Q3_K | Format::Q4_K | Format::Q5_K | Format::Q6_K => ActKind::Q8x256,
    }
}

thread_local! {
    /// A group's rows taken apart, for formats without a many-token group kernel (prefill of
    /// interleaved Q8_0: once per group and call, against every token of the tile).
    static GROUP_ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// f16 keys or values widened for a table without f16 attention kernels.
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A table of kernels for one instruction set.
#[derive(Clone)]
pub struct Kernels {
    /// Instruction set name (`scalar`, `avx2`, `avx512-vnni`, `neon`).
    pub isa: &'static str,
    pub(crate) f32_dot: unsafe fn(&[f32], &[f32]) -> f32,
    pub(crate) multi_dot: attn::MultiDot,
    pub(crate) multi_axpy: attn::MultiAxpy,
    /// Many keys or values at once (prefill's attention); `None`: one at a time.
    pub(crate) attn_scores: Option<attn::Scores>,
    pub(crate) attn_sum: Option<attn::WeightedSum>,
    /// The same over f16 keys and values, widened as loaded; `None`: widened into scratch.
    pub(crate) attn_scores_f16: Option<attn::ScoresF16>,
    pub(crate) attn_sum_f16: Option<attn::WeightedSumF16>,
    pub(crate) softmax_terms: attn::SoftmaxTerms,
    pub(crate) silu_mul: unsafe fn(&mut [f32], &[f32]),
    pub(crate) widen_f16: unsafe fn(&[u16], usize, usize, usize, &mut [f32]),
    pub(crate) narrow_f16: unsafe fn(&[f32], &mut [u16]),
    dots: [DotFn; FORMATS],
    gemms: [Option<gemm::GemmRow>; FORMATS],
    gemms4: [Option<gemm::GemmRows>; FORMATS],
    /// Eight interleaved rows of a 256-element-block format (Q4_K, Q2_K, Q3_K) against one
    /// token ([`Kernels::dot_group8`]).
    group8: [Option<Group8Fn>; FORMATS],
    /// The same for two and for three tokens at once.
    q4k_group8x2: Option<Group8x2Fn>,
    q4k_group8x3: Option<Group8x3Fn>,
    /// Tokens from which the many-token tiles beat those two- and three-token kernels.
    q4k_tiles_from: usize,
    /// Eight interleaved Q8_0 rows against one token, and against four.
    q8_0_group8: Option<Group8Q32Fn>,
    q8_0_group8x4: Option<Group8x4Q32Fn>,
    /// Eight interleaved rows against many tokens, read as they lie ([`Kernels::gemm_group8`]).
    gemm_group8: [Option<gemm::GemmGroup>; FORMATS],
    /// Products to token rows eight tokens at a time ([`Kernels::scatter_tokens`]).
    pub(crate) transpose8: Option<gemm::Transpose8>,
}

/// Eight interleaved rows against one token: `out[r]` (see [`smoe_quant::interleave`]).
pub type Group8Fn = unsafe fn(&[u8], &[Block256], &mut [f32; 8]);
/// [`Group8Fn`] for two tokens at once.
pub type Group8x2Fn = unsafe fn(&[u8], [&[Block256]; 2], [&mut [f32; 8]; 2]);
/// [`Group8Fn`] for three tokens at once.
pub type Group8x3Fn = unsafe fn(&[u8], [&[Block256]; 3], [&mut [f32; 8]; 3]);
/// [`Group8Fn`] for formats with 32-element blocks (Q8_0).
pub type Group8Q32Fn = unsafe fn(&[u8], &[Block32], &mut [f32; 8]);
/// [`Group8Q32Fn`] for four tokens at once.
pub type Group8x4Q32Fn = unsafe fn(&[u8], [&[Block32]; 4], [&mut [f32; 8]; 4]);

/// Formats in a kernel table.
const FORMATS: usize = smoe_quant::ALL_FORMATS.len();

fn slot(f: Format) -> usize {
    smoe_quant::ALL_FORMATS.iter().position(|&x| x == f).expect("every format is listed")
}

impl Kernels {
    /// The scalar reference table.
    pub fn scalar_table() -> Kernels {
        let mut dots = [DotFn::F32(scalar::dot_f32); FORMATS];
        for f in smoe_quant::ALL_FORMATS {
            dots[slot(f)] = match f {
                Format::F32 => DotFn::F32(scalar::dot_f32),
                Format::F16 => DotFn::F32(scalar::dot_f16),
                Format::BF16 => DotFn::F32(scalar::dot_bf16),
                Format::Q8_0 => DotFn::Q32(scalar::dot_q8_0),
                Format::Q4_0 => DotFn::Q32(scalar::dot_q4_0),
                Format::Q4_1 => DotFn::Q32(scalar::dot_q4_1),
                Format::Q5_0 => DotFn::Q32(scalar::dot_q5_0),
                Format::Q5_1 => DotFn::Q32(scalar::dot_q5_1),
                Format::Q2_K => DotFn::Q256(scalar::dot_q2_k),
                Format::Q3_K => DotFn::Q256(scalar::dot_q3_k),
                Format::Q4_K => DotFn::Q256(scalar::dot_q4_k),
                Format::Q5_K => DotFn::Q256(scalar::dot_q5_k),
                Format::Q6_K => DotFn::Q256(scalar::dot_q6_k),
                Format::MXFP4 => DotFn::Q32(scalar::dot_mxfp4),
                Format::MXFP8 => DotFn::Q32(scalar::dot_mxfp8),
                Format::FP8 => DotFn::Q32(scalar::dot_fp8),
            };
        }
        Kernels {
            isa: "scalar",
            f32_dot: scalar_f32_dot,
            multi_dot: attn::multi_dot,
            multi_axpy: attn::multi_axpy,
            attn_scores: None,
            attn_sum: None,
            attn_scores_f16: None,
            attn_sum_f16: None,
            softmax_terms: attn::softmax_terms,
            silu_mul: scalar_silu_mul,
            widen_f16: scalar::widen_f16,
            narrow_f16: scalar::narrow_f16,
            dots,
            gemms: [None; FORMATS],
            gemms4: [None; FORMATS],
            group8: [None; FORMATS],
            q4k_group8x2: None,
            q4k_group8x3: None,
            q4k_tiles_from: 4,
            q8_0_group8: None,
            q8_0_group8x4: None,
            gemm_group8: [None; FORMATS],
            transpose8: None,
        }
    }

    /// Sets `f`'s one-token kernel.
    pub(crate) fn set(&mut self, f: Format, d: DotFn) {
        self.dots[slot(f)] = d;
    }

    #[allow(dead_code)]
    pub(crate) fn set_gemm(&mut self, f: Format, g: gemm::GemmRow) {
        self.gemms[slot(f)] = Some(g);
    }

    #[allow(dead_code)]
    pub(crate) fn set_gemm4(&mut self, f: Format, g: gemm::GemmRows) {
        self.gemms4[slot(f)] = Some(g);
    }

    /// `out[r * n + t] = w[r] · a[t]` for [`gemm::ROWS`] rows; `false` if `f` has no such kernel.
    pub fn gemm_rows(&self, f: Format, w: [&[u8]; gemm::ROWS], tile: &gemm::ActTile<'_>, out: &mut [f32]) -> bool {
        match self.gemms4[slot(f)] {
            // SAFETY: as for `dot`: the table only holds kernels this CPU supports.
            Some(g) => unsafe { g(w, tile, out) },
            None => return false,
        }
        true
    }

    /// Whether `f` has a many-token kernel (see [`gemm`]).
    pub fn has_gemm(&self, f: Format) -> bool {
        self.gemms[slot(f)].is_some()
    }

    /// `out[t] = w · a[t]` for every token of `tile`; `false` if `f` has no such kernel.
    pub fn gemm_row(&self, f: Format, w: &[u8], tile: &gemm::ActTile<'_>, out: &mut [f32]) -> bool {
        match self.gemms[slot(f)] {
            // SAFETY: as for `dot`.
            Some(g) => unsafe { g(w, tile, out) },
            None => return false,
        }
        true
    }

    /// The dot product for weights in `f`.
    pub fn dot_fn(&self, f: Format) -> DotFn {
        self.dots[slot(f)]
    }

    /// `w · a` for one weight row in format `f` (whole blocks) and a matching activation row.
    pub fn dot(&self, f: Format, w: &[u8], a: ActRow<'_>) -> f32 {
        // SAFETY: the table holds only functions whose CPU features were detected at
        // construction (`best`, `available`), or scalar ones.
        unsafe {
            match (self.dots[slot(f)], a) {
                (DotFn::F32(k), ActRow::F32(x)) => k(w, x),
                (DotFn::Q32(k), ActRow::Q32(x)) => k(w, x),
                (DotFn::Q256(k), ActRow::Q256(x)) => k(w, x),
                _ => panic!("activation form does not match {f}"),
            }
        }
    }

    /// `out[i] = w[i] · a` for consecutive weight rows of `rb` bytes each (`out.len()` rows):
    /// the kernel is chosen once, not per row, which matters for decode's many short rows.
    pub fn dot_rows(&self, f: Format, w: &[u8], rb: usize, a: ActRow<'_>, out: &mut [f32]) {
        assert!(w.len() >= rb * out.len(), "dot_rows: weights too short");
        let row = |i: usize| &w[i * rb..(i + 1) * rb];
        // SAFETY: as for `dot`.
        unsafe {
            match (self.dots[slot(f)], a) {
                (DotFn::F32(k), ActRow::F32(x)) => out.iter_mut().enumerate().for_each(|(i, o)| *o = k(row(i), x)),
                (DotFn::Q32(k), ActRow::Q32(x)) => out.iter_mut().enumerate().for_each(|(i, o)| *o = k(row(i), x)),
                (DotFn::Q256(k), ActRow::Q256(x)) => out.iter_mut().enumerate().for_each(|(i, o)| *o = k(row(i), x)),
                _ => panic!("activation form does not match {f}"),
            }
        }
    }

    /// Whether matrices of `f` interleaved by eight rows have a kernel here: the engine
    /// interleaves only then.
    pub fn has_group8(&self, f: Format) -> bool {
        match f {
            Format::Q8_0 => self.q8_0_group8.is_some(),
            _ => self.group8[slot(f)].is_some(),
        }
    }

    #[allow(dead_code)]
    pub(crate) fn set_q8_0_group8(&mut self, one: Group8Q32Fn, four: Group8x4Q32Fn) {
        self.q8_0_group8 = Some(one);
        self.q8_0_group8x4 = Some(four);
    }

    /// [`Kernels::dot_group8`] for four tokens at once, with each token's bits what it gets
    /// alone; `false` (nothing written) where this table has no such kernel for `f`.
    pub fn dot_group8_x4(&self, f: Format, group: &[u8], cols: usize, a: [ActRow<'_>; 4], out: [&mut [f32; 8]; 4]) -> bool {
        let rb = f.row_bytes(cols).expect("a valid shape");
        assert!(group.len() >= 8 * rb, "dot_group8_x4: group too short");
        match (self.q8_0_group8x4, a) {
            (Some(k), [ActRow::Q32(a0), ActRow::Q32(a1), ActRow::Q32(a2), ActRow::Q32(a3)]) if f == Format::Q8_0 => {
                // SAFETY: as for `dot`.
                unsafe { k(&group[..8 * rb], [a0, a1, a2, a3], out) };
                true
            }
            _ => false,
        }
    }

    #[allow(dead_code)]
    pub(crate) fn set_group8(&mut self, g: Group8Fn, two: Group8x2Fn, three: Group8x3Fn, tiles_from: usize) {
        self.group8[slot(Format::Q4_K)] = Some(g);
        self.q4k_group8x2 = Some(two);
        self.q4k_group8x3 = Some(three);
        self.q4k_tiles_from = tiles_from;
    }

    /// Sets the one-token group kernel of a 256-element-block format other than Q4_K (whose
    /// few-token kernels come with it, [`Kernels::set_group8`]).
    #[allow(dead_code)]
    pub(crate) fn set_group8_one(&mut self, f: Format, g: Group8Fn) {
        assert!(matches!(f, Format::Q2_K | Format::Q3_K), "{f} has no group kernel of this kind");
        self.group8[slot(f)] = Some(g);
    }

    /// How many of `left` tokens (at least 2) the next [`Kernels::dot_group8_few`] call takes:
    /// threes, and twos where a three would leave one alone (4 = 2 + 2, 7 = 3 + 2 + 2).
    pub fn group8_few_next(left: usize) -> usize {
        if left == 2 || left == 4 {
            2
        } else {
            3
        }
    }

    /// Whether [`Kernels::dot_group8_few`] has two- and three-token kernels for `f`.
    pub fn has_group8_few(&self, f: Format) -> bool {
        f == Format::Q4_K && self.q4k_group8x2.is_some() && self.q4k_group8x3.is_some()
    }

    /// Tokens from which eight interleaved `f` rows are multiplied faster through the
    /// many-token tiles ([`Kernels::gemm_group8`]) than through [`Kernels::dot_group8_few`] in
    /// threes and twos, as this table measured on its CPUs; 4 where `f` has no few-token kernels.
    pub fn group8_tiles_from(&self, f: Format) -> usize {
        if self.has_group8_few(f) {
            self.q4k_tiles_from
        } else {
            4
        }
    }

    /// [`Kernels::dot_group8`] for two or three tokens at once (`a.len() == out.len()`), each
    /// token's bits what it gets alone: the weights are read and unpacked once for all of
    /// them (a batch's experts are mostly chosen by one to three of its tokens). `false`
    /// (nothing written) where this table has no such kernel for `f` and that many tokens.
    pub fn dot_group8_few(&self, f: Format, group: &[u8], cols: usize, a: &[ActRow<'_>], out: &mut [&mut [f32; 8]]) -> bool {
        let rb = f.row_bytes(cols).expect("a valid shape");
        assert!(group.len() >= 8 * rb && a.len() == out.len(), "dot_group8_few: group too short or counts differ");
        let g = &group[..8 * rb];
        match (f, a, out, self.q4k_group8x2, self.q4k_group8x3) {
            // SAFETY: as for `dot`.
            (Format::Q4_K, [ActRow::Q256(a0), ActRow::Q256(a1)], [o0, o1], Some(k), _) => unsafe { k(g, [a0, a1], [&mut **o0, &mut **o1]) },
            (Format::Q4_K, [ActRow::Q256(a0), ActRow::Q256(a1), ActRow::Q256(a2)], [o0, o1, o2], _, Some(k)) => {
                // SAFETY: as for `dot`.
                unsafe { k(g, [a0, a1, a2], [&mut **o0, &mut **o1, &mut **o2]) }
            }
            _ => return false,
        }
        true
    }

    #[allow(dead_code)]
    pub(crate) fn set_gemm_group8(&mut self, f: Format, g: gemm::GemmGroup) {
        self.gemm_group8[slot(f)] = Some(g);
    }

    /// `out[r * n + t]` = row `r` of a group of eight interleaved `f` rows (see
    /// [`smoe_quant::interleave`]) · token `t` of `tile`. Without a group kernel the rows are
    /// taken apart and go through [`Kernels::gemm_block`]; `false` if `f` has no many-token
    /// kernel at all.
    pub fn gemm_group8(&self, f: Format, group: &[u8], tile: &gemm::ActTile<'_>, out: &mut [f32]) -> bool {
        match self.gemm_group8[slot(f)] {
            // SAFETY: as for `dot`.
            Some(g) => unsafe { g(group, tile, out) },
            _ => {
                let rb = f.row_bytes(tile.cols).expect("a valid shape");
                return GROUP_ROWS.with(|rows| {
                    let rows = &mut *rows.borrow_mut();
                    rows.resize(8 * rb, 0);
                    smoe_quant::interleave::rows_of_group(f, group, tile.cols, rows);
                    self.gemm_block(f, rows, rb, tile, out)
                });
            }
        }
        true
    }

    /// `out[r * n + t] = w[r] · a[t]` for the consecutive rows of `rb` bytes in `w` and every
    /// token of `tile`: [`gemm::ROWS`] rows per call where `f` has such a kernel, then one at
    /// a time. `false` if `f` has no many-token kernel.
    pub fn gemm_block(&self, f: Format, w: &[u8], rb: usize, tile: &gemm::ActTile<'_>, out: &mut [f32]) -> bool {
        let (rows, n) = (w.len() / rb, tile.n);
        let row = |r: usize| &w[r * rb..(r + 1) * rb];
        let mut r = 0;
        while r + gemm::ROWS <= rows && self.gemm_rows(f, std::array::from_fn(|i| row(r + i)), tile, &mut out[r * n..]) {
            r += gemm::ROWS;
        }
        (r..rows).all(|r| self.gemm_row(f, row(r), tile, &mut out[r * n..(r + 1) * n]))
    }

    /// `out[r]` = row `r` of a group of eight interleaved `f` rows of `cols` (see
    /// [`smoe_quant::interleave`]) · `a`. Without a group kernel the rows are taken apart and
    /// go through the row kernel.
    pub fn dot_group8(&self, f: Format, group: &[u8], cols: usize, a: ActRow<'_>, out: &mut [f32; 8]) {
        let rb = f.row_bytes(cols).expect("a valid shape");
        assert!(group.len() >= 8 * rb, "dot_group8: group too short");
        match (self.group8[slot(f)], self.q8_0_group8, a) {
            // SAFETY: as for `dot`.
            (Some(k), _, ActRow::Q256(x)) => unsafe { k(&group[..8 * rb], x, out) },
            // SAFETY: as for `dot`.
            (_, Some(k), ActRow::Q32(x)) if f == Format::Q8_0 => unsafe { k(&group[..8 * rb], x, out) },
            _ => {
                let mut row = vec![0u8; rb];
                for (r, o) in out.iter_mut().enumerate() {
                    smoe_quant::interleave::row(f, group, cols, r, &mut row);
                    *o = self.dot(f, &row, a);
                }
            }
        }
    }

    /// `out[h] = q[h, :] · k` for the rows of `q` (see [`attn`]).
    pub fn multi_dot(&self, q: &[f32], k: &[f32], out: &mut [f32]) {
        assert!(q.len() >= out.len() * k.len());
        // SAFETY: as for `dot`.
        unsafe { (self.multi_dot)(q, k, out) }
    }

    /// `acc[h, :] += w[h] · v` (see [`attn`]).
    pub fn multi_axpy(&self, acc: &mut [f32], w: &[f32], v: &[f32]) {
        assert!(acc.len() >= w.len() * v.len());
        // SAFETY: as for `dot`.
        unsafe { (self.multi_axpy)(acc, w, v) }
    }

    /// A task's products, `src[i * n + t]` for `m` rows and `n` tokens (the many-token kernels'
    /// order), into each token's own row: `dest(t)[i]`. `dest` must give disjoint rows of at
    /// least `m` for different tokens.
    pub fn scatter_tokens<'o>(&self, src: &[f32], m: usize, n: usize, dest: impl Fn(usize) -> &'o mut [f32]) {
        assert!(src.len() >= m * n, "scatter_tokens: products too short");
        let mut t = 0;
        if let Some(f) = self.transpose8 {
            while t + 8 <= n {
                let mut out: [&mut [f32]; 8] = std::array::from_fn(|i| dest(t + i));
                assert!(out.iter().all(|o| o.len() >= m), "scatter_tokens: a token row is too short");
                // SAFETY: as for `dot`.
                unsafe { f(src, m, n, t, &mut out) };
                t += 8;
            }
        }
        for t in t..n {
            for (i, v) in dest(t)[..m].iter_mut().enumerate() {
                *v = src[i * n + t];
            }
        }
    }

    /// `out[j * rows + r] = q[r, :] · keys[j * stride..][..d]`: the `rows` rows of `q` (each
    /// `d` long) against `n` keys. Each score is bit for bit what [`Kernels::multi_dot`] gives.
    pub fn attn_scores(&self, q: &[f32], d: usize, keys: &[f32], stride: usize, n: usize, out: &mut [f32]) {
        assert!(d > 0 && q.len().is_multiple_of(d), "attn_scores: query rows of {d}");
        let rows = q.len() / d;
        assert!(out.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= keys.len()), "attn_scores: buffers too short");
        match self.attn_scores {
            // SAFETY: as for `dot`.
            Some(f) => unsafe { f(q, d, keys, stride, n, out) },
            None => (0..n).for_each(|j| self.multi_dot(q, &keys[j * stride..][..d], &mut out[j * rows..(j + 1) * rows])),
        }
    }

    /// `acc[r, :] += Σ_j p[j * rows + r] · values[j * stride..][..d]` over `n` values, for the
    /// `rows` rows of `acc` (each `d` long). Each output is bit for bit what
    /// [`Kernels::multi_axpy`] gives, value by value.
    pub fn attn_weighted_sum(&self, acc: &mut [f32], d: usize, p: &[f32], values: &[f32], stride: usize, n: usize) {
        assert!(d > 0 && acc.len().is_multiple_of(d), "attn_weighted_sum: rows of {d}");
        let rows = acc.len() / d;
        assert!(p.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= values.len()), "attn_weighted_sum: buffers too short");
        match self.attn_sum {
            // SAFETY: as for `dot`.
            Some(f) => unsafe { f(acc, d, p, values, stride, n) },
            None => (0..n).for_each(|j| self.multi_axpy(acc, &p[j * rows..(j + 1) * rows], &values[j * stride..][..d])),
        }
    }

    /// [`Kernels::attn_scores`] against f16 keys (`keys[j * stride..][..d]`, IEEE half bits):
    /// bit for bit [`Kernels::attn_scores`] on the keys widened to f32 (an f16 KV cache).
    pub fn attn_scores_f16(&self, q: &[f32], d: usize, keys: &[u16], stride: usize, n: usize, out: &mut [f32]) {
        assert!(d > 0 && q.len().is_multiple_of(d), "attn_scores_f16: query rows of {d}");
        let rows = q.len() / d;
        assert!(out.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= keys.len()), "attn_scores_f16: buffers too short");
        match self.attn_scores_f16 {
            // SAFETY: as for `dot`.
            Some(f) => unsafe { f(q, d, keys, stride, n, out) },
            None => self.widened(keys, n, d, stride, |w| self.attn_scores(q, d, w, d, n, out)),
        }
    }

    /// [`Kernels::attn_weighted_sum`] over f16 values: bit for bit it on the values widened to
    /// f32.
    pub fn attn_weighted_sum_f16(&self, acc: &mut [f32], d: usize, p: &[f32], values: &[u16], stride: usize, n: usize) {
        assert!(d > 0 && acc.len().is_multiple_of(d), "attn_weighted_sum_f16: rows of {d}");
        let rows = acc.len() / d;
        assert!(p.len() >= n * rows && (n == 0 || (n - 1) * stride + d <= values.len()), "attn_weighted_sum_f16: buffers too short");
        match self.attn_sum_f16 {
            // SAFETY: as for `dot`.
            Some(f) => unsafe { f(acc, d, p, values, stride, n) },
            None => self.widened(values, n, d, stride, |w| self.attn_weighted_sum(acc, d, p, w, d, n)),
        }
    }

    /// `f` on `n` rows of `d` f16 values (`stride` apart) widened, side by side, into this
    /// thread's scratch: the f16 attention of a table without f16 tiles.
    fn widened(&self, src: &[u16], n: usize, d: usize, stride: usize, f: impl FnOnce(&[f32])) {
        WIDE.with(|w| {
            let mut w = w.borrow_mut();
            w.resize(n * d, 0.0);
            self.f16_rows_to_f32(src, n, d, stride, &mut w);
            f(&w)
        })
    }

    /// Softmax terms of one token's rows at one position: `v[i] = exp(v[i] - m[i])` and
    /// `sum[i] += v[i]`, for `v`, `m` and `sum` of one length. The SIMD tables use a polynomial
    /// `exp` (within 2 ulp of the correctly rounded value) whose result does not depend on a
    /// value's place in the slice, so a row's terms are the same whatever rows surround it.
    pub fn softmax_terms(&self, v: &mut [f32], m: &[f32], sum: &mut [f32]) {
        assert!(m.len() == v.len() && sum.len() == v.len(), "softmax_terms: lengths differ");
        // SAFETY: as for `dot`.
        unsafe { (self.softmax_terms)(v, m, sum) }
    }

    /// SwiGLU's `g[i] = silu(g[i]) · u[i] = g[i] / (1 + exp(-g[i])) · u[i]`. The SIMD tables
    /// use a polynomial `exp` (within 2 ulp where the output is a normal f32; see
    /// [`Kernels::softmax_terms`]) that gives a value the same result wherever it lies in the
    /// slice; NaN in, NaN out.
    pub fn silu_mul(&self, g: &mut [f32], u: &[f32]) {
        assert_eq!(g.len(), u.len(), "silu_mul: lengths differ");
        // SAFETY: as for `dot`.
        unsafe { (self.silu_mul)(g, u) }
    }

    /// `n` rows of `len` fp16 values, `stride` apart in `src`, to f32 rows of `len` side by
    /// side in `dst`, exactly: one call for a block of one head's cached keys.
    pub fn f16_rows_to_f32(&self, src: &[u16], n: usize, len: usize, stride: usize, dst: &mut [f32]) {
        assert!(n == 0 || ((n - 1) * stride + len <= src.len() && n * len <= dst.len()), "f16_rows_to_f32: buffers too short");
        // SAFETY: as for `dot`.
        unsafe { (self.widen_f16)(src, n, len, stride, dst) }
    }

    /// f32 to fp16 bits, rounding to nearest even; every table gives the same bits (a NaN
    /// stays a NaN, its payload aside).
    pub fn f32_to_f16(&self, src: &[f32], dst: &mut [u16]) {
        assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths differ");
        // SAFETY: as for `dot`.
        unsafe { (self.narrow_f16)(src, dst) }
    }

    /// `a · b` in f32 (attention, f32 weights).
    pub fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as for `dot`.
        unsafe { (self.f32_dot)(a, b) }
    }
}

fn scalar_silu_mul(g: &mut [f32], u: &[f32]) {
    for (a, &b) in g.iter_mut().zip(u) {
        *a = *a / (1.0 + (-*a).exp()) * b;
    }
}

fn scalar_f32_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len().min(b.len());
    for i in 0..n / 8 {
        for j in 0..8 {
            acc[j] += a[8 * i + j] * b[8 * i + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n / 8 * 8..n {
        s += a[i] * b[i];
    }
    s
}

/// Asks for `n` rows of `len` floats, `stride` apart from the start of `data`, to be brought
/// towards the core (into L2) ahead of use: decode attention asks for a block's cached values
/// while it computes the block's scores, so that the weighted sum does not wait on them (its
/// rows lie 2 KB and more apart, where the hardware prefetchers help little). A hint: it
/// changes no memory and never faults; a no-op off x86-64.
pub fn prefetch_rows(data: &[f32], stride: usize, n: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for j in 0..n {
        let row = data.get(j * stride..).map_or(&[][..], |r| &r[..len.min(r.len())]);
        for i in (0..row.len()).step_by(16) {
            // SAFETY: a prefetch of an address inside `row`; it never faults in any case.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(row.as_ptr().add(i) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, stride, n, len);
}

/// Every table this CPU can run, best first (the scalar one last).
pub fn available() -> Vec<Kernels> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        v.extend(x86::amx_table());
        v.extend(x86::avx512_table());
        v.extend(x86::avx2_table());
    }
    #[cfg(target_arch = "aarch64")]
    v.extend(arm::neon_table());
    v.push(Kernels::scalar_table());
    v
}

/// The best table for this CPU, chosen once (override with `SMOE_ISA=scalar|avx2|...`). The
/// AMX table is chosen only when asked for (`SMOE_ISA=avx512-amx` or `SMOE_AMX=on`): on the
/// Sapphire Rapids host it was no faster than VNNI (docs/benchmarks.md, issue #23).
pub fn best() -> &'static Kernels {
    static BEST: OnceLock<Kernels> = OnceLock::new();
    BEST.get_or_init(|| {
        let all = available();
        let want = std::env::var("SMOE_ISA").ok();
        let amx = std::env::var("SMOE_AMX").is_ok_and(|v| matches!(v.as_str(), "on" | "1" | "yes"));
        let default = all.iter().find(|k| amx || k.isa != "avx512-amx").unwrap_or(&all[0]);
        let k = want.as_deref().and_then(|w| all.iter().find(|k| k.isa == w)).unwrap_or(default).clone();
        tracing::info!("kernels: chose {} (available: {})", k.isa, all.iter().map(|k| k.isa).collect::<Vec<_>>().join(", "));
        k
    })
}

#[cfg(test)]
mod tests;
