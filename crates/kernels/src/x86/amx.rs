//! AMX (Advanced Matrix Extensions, Sapphire Rapids and later) many-token kernels: one tile
//! instruction multiplies 8 weight rows by 64 weights of 8 tokens, where AVX-512 VNNI takes 128
//! `vpdpbusd`s and their broadcasts.
//!
//! Interleaved groups of Q4_K (prefill's expert products) and Q8_0 (the dense projections)
//! have one. Their integers are those of the VNNI kernels and their floats come from the same
//! operations in the same order, so they give those kernels' bits (a test checks, on a CPU
//! that has AMX). For Q4_K, a super-block's sum
//! `Σ_j sc_j Σ_e q_e a_e` needs each 32-weight group's product times its 6-bit scale, but the
//! tiles accumulate over the whole row: the weights are unpacked once per call as `q·sc` split
//! into two bytes, `q·sc = 32·hi + lo` (`q·sc` ≤ 945), so that three accumulations over the
//! super-block give the scaled sum (`32·Σ hi·a + Σ lo·a`) and the minimums (`Σ m_j·a`, the
//! group's min repeated over its weights) with no work per group.
//!
//! The tiles are configured at the start of each call and released at its end: a thread that
//! holds them makes every context switch save 8 KiB more. Linux hands AMX state out only on
//! request ([`usable`] asks once); rustc has no AMX intrinsics on stable, so the tile
//! instructions are inline assembly over fixed tile registers, which the compiler never uses.

use super::gemm::{transpose8x8, unpack_q4_k_group, Unpacked};
use crate::gemm::{ActTile, TILE};
use smoe_quant::interleave::{GROUP_BLOCK, Q8_GROUP_BLOCK, ROWS as GROUP};
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the OS lets this process use them (on Linux,
/// granted on the first call through `arch_prctl(ARCH_REQ_XCOMP_PERM)`). `SMOE_AMX=off` says
/// no. Where it says yes, the `avx512-amx` table is available (and tested) but chosen only on
/// request ([`crate::best`]): measured on Sapphire Rapids, the per-call unpacking of the
/// weights into tile rows cost what the tiles saved (one core, 32 tokens: Q4_K 34.7 GMAC/s
/// against VNNI's 79.7; 512 tokens: 82.3 against 76.2).
pub fn usable() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("SMOE_AMX").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "no")) {
            return false;
        }
        let leaf7 = __cpuid_count(7, 0);
        let (tile, int8) = ((leaf7.edx >> 24) & 1 == 1, (leaf7.edx >> 25) & 1 == 1);
        if !(tile && int8 && permitted()) {
            return false;
        }
        // SAFETY: AMX-TILE and AMX-INT8 reported and the tile state granted, just above.
        let same = unsafe { tiles_agree::<Amx, Emulated>(0x5eed) };
        if !same {
            eprintln!("smoe: this CPU's AMX tile products differ from their definition; using AVX-512 VNNI instead");
        }
        same
    })
}

/// Whether `A` and `B` give the same sums for both kernels' tile products, on bytes that
/// cover every sign case (unsigned weights above 127, negative tokens). Run once before the
/// AMX table is offered: the kernels' layouts are tested on [`Emulated`] tiles anywhere, and
/// this ties the instructions to that emulation on the CPU at hand, so a misreading of their
/// operands or shapes falls back to VNNI instead of giving wrong products.
///
/// # Safety
/// Where `A` or `B` is [`Amx`], AMX must be usable.
unsafe fn tiles_agree<A: Tiles, B: Tiles>(seed: u64) -> bool {
    let mut x = seed;
    let mut byte = move || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 56) as u8
    };
    // Q4_K: three weight arrays of 8 rows × 256, rows 256 apart; 64 dwords of 8 tokens.
    #[repr(C, align(64))]
    struct Buf<const N: usize>([u8; N]);
    let mut w = [Buf([0u8; 8 * 256]), Buf([0u8; 8 * 256]), Buf([0u8; 8 * 256])];
    let mut b = Buf([0u8; 64 * 32]);
    for v in w.iter_mut().flat_map(|w| w.0.iter_mut()).chain(b.0.iter_mut()) {
        *v = byte();
    }
    let (mut ca, mut cb) = (Buf([0u8; 4 * 3 * 64 * 4]), Buf([0u8; 4 * 3 * 64 * 4]));
    let wp = [w[0].0.as_ptr(), w[1].0.as_ptr(), w[2].0.as_ptr()];
    // SAFETY: the reads and writes each call documents lie in the buffers above (weights 8 ×
    // 256 bytes with rows 256 apart, 2,048 token bytes, 3 × 64 i32 of sums); AMX as the caller
    // guarantees.
    unsafe {
        A::begin(q4_k_config());
        A::q4_k_superblock(wp, 256, b.0.as_ptr() as *const i8, ca.0.as_mut_ptr() as *mut i32);
        A::end();
        B::begin(q4_k_config());
        B::q4_k_superblock(wp, 256, b.0.as_ptr() as *const i8, cb.0.as_mut_ptr() as *mut i32);
        B::end();
    }
    let q4k = ca.0[..3 * 64 * 4] == cb.0[..3 * 64 * 4];
    // Q8_0: four blocks of 8 rows × 32, rows 128 apart; four tiles of 8 dwords × 8 tokens.
    let (a, y) = (w[0].0.as_ptr() as *const i8, b.0.as_ptr() as *const i8);
    // SAFETY: weights 8 rows of 128 bytes (2,048 here), tokens 4 × 256 bytes (2,048 here),
    // 4 × 64 i32 of sums (768 i32 here); AMX as the caller guarantees.
    unsafe {
        A::begin(q8_0_config());
        A::q8_0_blocks::<4>(a, 128, y, ca.0.as_mut_ptr() as *mut i32);
        A::end();
        B::begin(q8_0_config());
        B::q8_0_blocks::<4>(a, 128, y, cb.0.as_mut_ptr() as *mut i32);
        B::end();
    }
    q4k && ca.0[..4 * 64 * 4] == cb.0[..4 * 64 * 4]
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA`), then
/// checks that the OS enabled both tile state components in XCR0.
#[cfg(target_os = "linux")]
fn permitted() -> bool {
    const SYS_ARCH_PRCTL: isize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let rc: isize;
    // SAFETY: the arch_prctl system call with ARCH_REQ_XCOMP_PERM only changes which XSAVE
    // components the kernel lets this process use; it reads and writes none of our memory.
    // `syscall` clobbers rcx and r11, declared.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => rc,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        )
    };
    // OSXSAVE (XGETBV usable), then XCR0's XTILECFG (17) and XTILEDATA (18).
    let osxsave = (__cpuid(1).ecx >> 27) & 1 == 1;
    rc == 0 && osxsave && {
        // SAFETY: XGETBV is available when CPUID reports OSXSAVE (checked just above).
        let xcr0 = unsafe { xcr0() };
        (xcr0 >> 17) & 3 == 3
    }
}

#[cfg(not(target_os = "linux"))]
fn permitted() -> bool {
    false
}

/// XCR0.
///
/// # Safety
/// The CPU must report OSXSAVE.
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: XGETBV of XCR0, which every CPU with OSXSAVE has (the caller's contract).
    unsafe { _xgetbv(0) }
}

/// A tile configuration (`LDTILECFG`'s 64-byte operand, palette 1).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    /// Palette 1 with tile `t` of `rows` rows of `colsb` bytes for each `(t, rows, colsb)`.
    fn new(tiles: &[(usize, u8, u16)]) -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        for &(t, rows, colsb) in tiles {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows;
        }
        TileConfig(c)
    }
}

/// The Q4_K kernel's tiles: `tmm0..3` the sums (8 rows × 8 tokens of i32: hi, lo, min),
/// `tmm3..6` the weights (8 rows × 64 bytes: hi, lo, min), `tmm6` the tokens (16 dwords × 8
/// tokens).
fn q4_k_config() -> &'static TileConfig {
    static C: OnceLock<TileConfig> = OnceLock::new();
    C.get_or_init(|| TileConfig::new(&[(0, 8, 32), (1, 8, 32), (2, 8, 32), (3, 8, 64), (4, 8, 64), (5, 8, 64), (6, 16, 32)]))
}

/// The tile operations the kernels use: the AMX instructions ([`Amx`]), or the same arithmetic
/// in scalar code ([`Emulated`]), which lets the kernels' layouts and offsets be tested on any
/// CPU with AVX-512 (the instructions themselves only where AMX is).
trait Tiles {
    /// Loads the tile configuration.
    ///
    /// # Safety
    /// [`Amx`]: AMX must be usable.
    unsafe fn begin(config: &TileConfig);

    /// Releases the tiles.
    ///
    /// # Safety
    /// [`Amx`]: AMX must be usable.
    unsafe fn end();

    /// Q4_K, one super-block of 8 rows against one token tile: for `w` in hi, lo, min
    /// (`[row][weight]`, rows `ws` bytes apart, 256 weights from each pointer), the 8 × 8 sums
    /// `Σ_e w[r][e] · b[e][t]` as i32 at `c` (`[w][row][token]`), where `b` is 64 dwords of
    /// 8 tokens (`[dword][token][4]`).
    ///
    /// # Safety
    /// The pointers valid for those reads and 3 × 64 i32 of writes; `begin(q4_k_config())`.
    unsafe fn q4_k_superblock(w: [*const u8; 3], ws: usize, b: *const i8, c: *mut i32);

    /// Q8_0, `N` (1 or 4) blocks of 8 rows against one token tile: block `i`'s 8 × 8 sums
    /// `Σ_e a[r][32i + e] · y[8i dwords + e][t]` at `c + 64i` (`[row][token]`), rows of `a`
    /// `ws` bytes apart.
    ///
    /// # Safety
    /// The pointers valid for those reads and N × 64 i32 of writes; `begin(q8_0_config())`.
    unsafe fn q8_0_blocks<const N: usize>(a: *const i8, ws: usize, y: *const i8, c: *mut i32);
}

/// The AMX instructions.
struct Amx;

impl Tiles for Amx {
    #[inline(always)]
    unsafe fn begin(config: &TileConfig) {
        // SAFETY: a valid palette-1 operand of 64 aligned bytes; AMX usable (the caller).
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    }

    #[inline(always)]
    unsafe fn end() {
        // SAFETY: AMX usable (the caller).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    #[inline(always)]
    unsafe fn q4_k_superblock(w: [*const u8; 3], ws: usize, b: *const i8, c: *mut i32) {
        // SAFETY: `tmm3..6` take 8 rows of 64 weights at w + 64k + r·ws, `tmm6` 16 rows of 32
        // bytes at b + 512k + 32j (k < 4): the reads the caller guarantees; `tmm0..3` go to
        // c (8 rows of 32 bytes each, 256 bytes apart).
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tileloadd tmm3, [{hi} + {ws}]",
                "tileloadd tmm4, [{lo} + {ws}]",
                "tileloadd tmm5, [{m} + {ws}]",
                "tileloadd tmm6, [{b} + {bs}]",
                "tdpbusd tmm0, tmm3, tmm6",
                "tdpbusd tmm1, tmm4, tmm6",
                "tdpbusd tmm2, tmm5, tmm6",
                "tileloadd tmm3, [{hi} + {ws} + 64]",
                "tileloadd tmm4, [{lo} + {ws} + 64]",
                "tileloadd tmm5, [{m} + {ws} + 64]",
                "tileloadd tmm6, [{b} + {bs} + 512]",
                "tdpbusd tmm0, tmm3, tmm6",
                "tdpbusd tmm1, tmm4, tmm6",
                "tdpbusd tmm2, tmm5, tmm6",
                "tileloadd tmm3, [{hi} + {ws} + 128]",
                "tileloadd tmm4, [{lo} + {ws} + 128]",
                "tileloadd tmm5, [{m} + {ws} + 128]",
                "tileloadd tmm6, [{b} + {bs} + 1024]",
                "tdpbusd tmm0, tmm3, tmm6",
                "tdpbusd tmm1, tmm4, tmm6",
                "tdpbusd tmm2, tmm5, tmm6",
                "tileloadd tmm3, [{hi} + {ws} + 192]",
                "tileloadd tmm4, [{lo} + {ws} + 192]",
                "tileloadd tmm5, [{m} + {ws} + 192]",
                "tileloadd tmm6, [{b} + {bs} + 1536]",
                "tdpbusd tmm0, tmm3, tmm6",
                "tdpbusd tmm1, tmm4, tmm6",
                "tdpbusd tmm2, tmm5, tmm6",
                "tilestored [{c} + {bs}], tmm0",
                "tilestored [{c} + {bs} + 256], tmm1",
                "tilestored [{c} + {bs} + 512], tmm2",
                hi = in(reg) w[0],
                lo = in(reg) w[1],
                m = in(reg) w[2],
                ws = in(reg) ws,
                b = in(reg) b,
                bs = in(reg) TILE * 4,
                c = in(reg) c,
                options(nostack)
            )
        };
    }

    #[inline(always)]
    unsafe fn q8_0_blocks<const N: usize>(a: *const i8, ws: usize, y: *const i8, c: *mut i32) {
        // SAFETY: the weight tiles take 8 rows of 32 bytes at a + 32i + r·ws, the token tiles
        // 8 rows of 32 bytes at y + 256i (i < N): the reads the caller guarantees; the sums go
        // to c + 256i bytes.
        unsafe {
            if N == 4 {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "tileloadd tmm4, [{a} + {ws}]",
                    "tileloadd tmm6, [{y} + {bs}]",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tileloadd tmm5, [{a} + {ws} + 32]",
                    "tileloadd tmm7, [{y} + {bs} + 256]",
                    "tdpbssd tmm1, tmm5, tmm7",
                    "tileloadd tmm4, [{a} + {ws} + 64]",
                    "tileloadd tmm6, [{y} + {bs} + 512]",
                    "tdpbssd tmm2, tmm4, tmm6",
                    "tileloadd tmm5, [{a} + {ws} + 96]",
                    "tileloadd tmm7, [{y} + {bs} + 768]",
                    "tdpbssd tmm3, tmm5, tmm7",
                    "tilestored [{o} + {bs}], tmm0",
                    "tilestored [{o} + {bs} + 256], tmm1",
                    "tilestored [{o} + {bs} + 512], tmm2",
                    "tilestored [{o} + {bs} + 768], tmm3",
                    a = in(reg) a, ws = in(reg) ws, y = in(reg) y, bs = in(reg) TILE * 4, o = in(reg) c,
                    options(nostack)
                );
            } else {
                assert_eq!(N, 1);
                asm!(
                    "tilezero tmm0",
                    "tileloadd tmm4, [{a} + {ws}]",
                    "tileloadd tmm6, [{y} + {bs}]",
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tilestored [{o} + {bs}], tmm0",
                    a = in(reg) a, ws = in(reg) ws, y = in(reg) y, bs = in(reg) TILE * 4, o = in(reg) c,
                    options(nostack)
                );
            }
        }
    }
}

/// The tile operations in scalar code: the definition the AMX instructions are checked
/// against at start ([`tiles_agree`]), and the kernels' tiles in tests on CPUs without AMX.
struct Emulated;

/// `C[r][t] += Σ_k Σ_i A[r][4k + i] · B[k][t][i]` for `k < kd` dwords, 8 rows and 8 tokens:
/// `tdpbusd` / `tdpbssd` on 8 × 8 tiles (`A` unsigned or signed as `signed` says).
///
/// # Safety
/// `a`: 8 rows of 4·kd bytes, `ws` apart; `b`: kd × 32 bytes; `c`: 64 i32.
unsafe fn dot_tile(a: *const u8, ws: usize, signed: bool, b: *const i8, kd: usize, c: *mut i32) {
    for r in 0..8 {
        for t in 0..8 {
            let mut sum = 0i32;
            for e in 0..4 * kd {
                // SAFETY: within the reads the caller guarantees.
                let (x, y) = unsafe { (*a.add(r * ws + e), *b.add((e / 4) * 32 + 4 * t + e % 4)) };
                let x = if signed { x as i8 as i32 } else { x as i32 };
                sum = sum.wrapping_add(x * y as i32);
            }
            // SAFETY: 64 i32 at c.
            unsafe { *c.add(8 * r + t) = (*c.add(8 * r + t)).wrapping_add(sum) };
        }
    }
}

impl Tiles for Emulated {
    unsafe fn begin(_: &TileConfig) {}

    unsafe fn end() {}

    unsafe fn q4_k_superblock(w: [*const u8; 3], ws: usize, b: *const i8, c: *mut i32) {
        for (k, w) in w.into_iter().enumerate() {
            // SAFETY: as the caller guarantees for the AMX version.
            unsafe {
                std::ptr::write_bytes(c.add(64 * k), 0, 64);
                dot_tile(w, ws, false, b, 64, c.add(64 * k));
            }
        }
    }

    unsafe fn q8_0_blocks<const N: usize>(a: *const i8, ws: usize, y: *const i8, c: *mut i32) {
        for i in 0..N {
            // SAFETY: as the caller guarantees for the AMX version.
            unsafe {
                std::ptr::write_bytes(c.add(64 * i), 0, 64);
                dot_tile((a as *const u8).add(32 * i), ws, true, y.add(256 * i), 8, c.add(64 * i));
            }
        }
    }
}

/// A group's rows unpacked for the tiles, row-major (`[row][weight]`): `q·sc` split as
/// `32·hi + lo`, the group minimum repeated over its 32 weights, `d` and `dmin` per
/// super-block and row (`[sb][row]`).
#[derive(Default)]
struct TileRows {
    hi: Vec<u8>,
    lo: Vec<u8>,
    m: Vec<u8>,
    g: Unpacked,
}

thread_local! {
    static ROWS: RefCell<TileRows> = RefCell::new(TileRows::default());
}

/// Fills `t` from an interleaved group of `cols`: the group unpacked as the VNNI kernel does,
/// then each 8-row × 8-dword block of quants transposed to rows and scaled.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
fn unpack(w: &[u8], cols: usize, t: &mut TileRows) -> usize {
    let sbs = unpack_q4_k_group(w, &mut t.g);
    assert_eq!(256 * sbs, cols, "amx: group and tile differ");
    for v in [&mut t.hi, &mut t.lo, &mut t.m] {
        v.resize(GROUP * cols, 0);
    }
    let g = &t.g;
    assert!(g.q.len() >= GROUP * cols && g.sc.len() >= GROUP * 8 * sbs && g.mins.len() >= GROUP * 8 * sbs);
    let low5 = _mm512_set1_epi16(31);
    for s in 0..sbs {
        for j in 0..8 {
            // Dword k of the group (weights 4k.. of every row, a row per lane).
            let mut d = [_mm256_setzero_ps(); 8];
            for (k, d) in d.iter_mut().enumerate() {
                // SAFETY: 32 bytes at 32 * (64s + 8j + k) + 32 <= 32 * 64 * sbs = GROUP * cols
                // <= g.q.len() (asserted).
                *d = unsafe { _mm256_loadu_ps(g.q.as_ptr().add(32 * (64 * s + 8 * j + k)) as *const f32) };
            }
            let rows = transpose8x8(&d);
            let group = 8 * s + j;
            for (r, v) in rows.iter().enumerate() {
                let (sc, m) = (g.sc[group * GROUP + r], g.mins[group * GROUP + r]);
                let q = _mm512_cvtepu8_epi16(_mm256_castps_si256(*v));
                let p = _mm512_mullo_epi16(q, _mm512_set1_epi16(sc as i16));
                let at = r * cols + 256 * s + 32 * j;
                // SAFETY: 32 bytes at r * cols + 256s + 32j + 32 <= GROUP * cols (resized).
                unsafe {
                    _mm256_storeu_si256(t.hi.as_mut_ptr().add(at) as *mut __m256i, _mm512_cvtepi16_epi8(_mm512_srli_epi16::<5>(p)));
                    _mm256_storeu_si256(t.lo.as_mut_ptr().add(at) as *mut __m256i, _mm512_cvtepi16_epi8(_mm512_and_si512(p, low5)));
                    _mm256_storeu_si256(t.m.as_mut_ptr().add(at) as *mut __m256i, _mm256_set1_epi8(m as i8));
                }
            }
        }
    }
    sbs
}

/// An interleaved group of [`GROUP`] Q4_K rows × tokens with AMX: `out[r * n + t]`, the bits
/// of `q4_k_vnni_group`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512F/BW/VL and AMX-TILE/INT8, and [`usable`] must
/// have returned `true`; `w` is whole super-blocks of a group of `tile.cols`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn q4_k_group(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: as this function's caller guarantees.
    unsafe { q4_k_tiles::<Amx>(w, tile, out) }
}

/// [`q4_k_group`] with its tile operations from `T`.
///
/// # Safety
/// As [`q4_k_group`], where `T` is [`Amx`]; AVX-512F/BW/DQ for any `T`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn q4_k_tiles<T: Tiles>(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    assert_eq!(w.len(), GROUP_BLOCK * tile.cols / 256, "q4_k_amx_group: group and tile differ");
    let (n, cols, dwords) = (tile.n, tile.cols, tile.cols / 4);
    assert!(out.len() >= GROUP * n && tile.block == 256);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    ROWS.with(|cell| {
        let t = &mut *cell.borrow_mut();
        let sbs = unpack(w, cols, t);
        assert!(tile.d.len() >= tile.tiles() * sbs * TILE);
        let (d, dmin) = (&t.g.d, &t.g.dmin);
        assert!(d.len() >= GROUP * sbs && dmin.len() >= GROUP * sbs);
        // The three sums of one super-block and tile: [hi | lo | min][row][token].
        #[repr(C, align(64))]
        struct Sums([i32; 3 * GROUP * TILE]);
        let mut c = Sums([0; 3 * GROUP * TILE]);
        // SAFETY: AMX is usable where `T` is `Amx` (this function's contract).
        unsafe { T::begin(q4_k_config()) };
        for gt in 0..tile.tiles() {
            let qs = tile.qs[gt * dwords * TILE * 4..].as_ptr();
            let (mut total, mut totalm) = ([_mm512_setzero_ps(); 4], [_mm512_setzero_ps(); 4]);
            for s in 0..sbs {
                // SAFETY: the weight tiles read rows r < 8 of 64 bytes at r * cols + 256s + 64c,
                // c < 4: within GROUP * cols bytes of hi, lo and m (unpacked); the token tiles 16
                // rows of 32 bytes from dword 64s + 16c of tile `gt`: within its dwords * 32
                // bytes (asserted); the stores 3 × 8 rows of 32 bytes into `c`.
                unsafe {
                    let at = 256 * s;
                    T::q4_k_superblock(
                        [t.hi.as_ptr().add(at), t.lo.as_ptr().add(at), t.m.as_ptr().add(at)],
                        cols,
                        qs.add(64 * s * TILE * 4),
                        c.0.as_mut_ptr(),
                    )
                };
                // The same float operations as the VNNI body, two rows (eight tokens each)
                // per register: sum × (d · da) and min-sum × (dmin · da), per super-block.
                // SAFETY: 8 floats at (gt * sbs + s) * TILE + 8 <= d.len() (asserted).
                let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((gt * sbs + s) * TILE)) };
                let da = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(da), da);
                for p in 0..GROUP / 2 {
                    // Plain statements, not closures: a closure is not compiled with this
                    // function's target features, and its intrinsics would become calls.
                    let (r0, r1) = (GROUP * s + 2 * p, GROUP * s + 2 * p + 1);
                    let dd = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d[r0]), _mm512_set1_ps(d[r1]));
                    let dm = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(dmin[r0]), _mm512_set1_ps(dmin[r1]));
                    let sums = c.0.as_ptr();
                    // SAFETY: 16 aligned i32 at 16p, GROUP * TILE + 16p and 2 * GROUP * TILE +
                    // 16p, all within the 3 * GROUP * TILE of `c`.
                    let (hi, lo, m) = unsafe {
                        (
                            _mm512_load_si512(sums.add(16 * p) as *const _),
                            _mm512_load_si512(sums.add(GROUP * TILE + 16 * p) as *const _),
                            _mm512_load_si512(sums.add(2 * GROUP * TILE + 16 * p) as *const _),
                        )
                    };
                    let sumi = _mm512_add_epi32(_mm512_slli_epi32::<5>(hi), lo);
                    total[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(dd, da), total[p]);
                    totalm[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dm, da), totalm[p]);
                }
            }
            let mut v = [_mm512_setzero_ps(); GROUP / 2];
            for p in 0..GROUP / 2 {
                v[p] = _mm512_sub_ps(total[p], totalm[p]);
            }
            store_pairs(&v, out, n, gt);
        }
        // SAFETY: releases the tiles this call configured.
        unsafe { T::end() };
    });
}

/// The Q8_0 kernel's tiles, all 8 rows × 32 bytes: `tmm0..4` four blocks' sums (8 rows × 8
/// tokens of i32), `tmm4`, `tmm5` weights (8 rows × 32), `tmm6`, `tmm7` tokens (8 dwords × 8
/// tokens).
fn q8_0_config() -> &'static TileConfig {
    static C: OnceLock<TileConfig> = OnceLock::new();
    C.get_or_init(|| TileConfig::new(&(0..8).map(|t| (t, 8, 32)).collect::<Vec<_>>()))
}

/// A Q8_0 group's rows for the tiles: quants row-major (`[row][weight]`), scales `[block][row]`.
#[derive(Default)]
struct Q8Rows {
    q: Vec<i8>,
    d: Vec<f32>,
}

thread_local! {
    static Q8_ROWS: RefCell<Q8Rows> = RefCell::new(Q8Rows::default());
}

/// Fills `t` from an interleaved Q8_0 group of `cols`: each block's `[dword][row]` quants
/// transposed to rows, its eight f16 scales widened.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q8_0(w: &[u8], cols: usize, t: &mut Q8Rows) -> usize {
    let blocks = cols / 32;
    assert_eq!(w.len(), blocks * Q8_GROUP_BLOCK, "amx: Q8_0 group and tile differ");
    t.q.resize(GROUP * cols, 0);
    t.d.resize(GROUP * blocks, 0.0);
    for (b, src) in w.chunks_exact(Q8_GROUP_BLOCK).enumerate() {
        let h: [u16; 8] = std::array::from_fn(|r| u16::from_le_bytes([src[2 * r], src[2 * r + 1]]));
        // SAFETY: 8 floats at 8b + 8 <= GROUP * blocks = d.len().
        unsafe { _mm256_storeu_ps(t.d.as_mut_ptr().add(GROUP * b), super::f16x8(&h)) };
        let mut d = [_mm256_setzero_ps(); 8];
        for (k, d) in d.iter_mut().enumerate() {
            // SAFETY: 32 bytes at 16 + 32k + 32 <= 272 = Q8_GROUP_BLOCK (chunks_exact).
            *d = unsafe { _mm256_loadu_ps(src.as_ptr().add(16 + 32 * k) as *const f32) };
        }
        for (r, v) in transpose8x8(&d).iter().enumerate() {
            // SAFETY: 32 bytes at r * cols + 32b + 32 <= GROUP * cols = q.len().
            unsafe { _mm256_storeu_ps(t.q.as_mut_ptr().add(r * cols + 32 * b) as *mut f32, *v) };
        }
    }
    blocks
}

/// An interleaved group of [`GROUP`] Q8_0 rows × tokens with AMX: `out[r * n + t]`, the bits
/// of the VNNI kernels on the rows taken apart. Each block's product is exact in i32 (signed
/// weights and tokens, `tdpbssd`, where VNNI biases the weights and takes the bias back), and
/// then scaled and added in the same order; four blocks are in flight at a time, since a tile
/// product's result takes several of its issue intervals to arrive.
///
/// # Safety
/// As [`q4_k_group`]; `w` is whole blocks of a group of `tile.cols`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
pub unsafe fn q8_0_group(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: as this function's caller guarantees.
    unsafe { q8_0_tiles::<Amx>(w, tile, out) }
}

/// [`q8_0_group`] with its tile operations from `T`.
///
/// # Safety
/// As [`q8_0_group`], where `T` is [`Amx`]; AVX-512F/BW/DQ for any `T`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn q8_0_tiles<T: Tiles>(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    let (n, cols, dwords) = (tile.n, tile.cols, tile.cols / 4);
    assert!(out.len() >= GROUP * n && tile.block == 32);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    Q8_ROWS.with(|cell| {
        let t = &mut *cell.borrow_mut();
        let blocks = unpack_q8_0(w, cols, t);
        assert!(tile.d.len() >= tile.tiles() * blocks * TILE && t.d.len() >= GROUP * blocks);
        #[repr(C, align(64))]
        struct Sums([i32; 4 * GROUP * TILE]);
        let mut c = Sums([0; 4 * GROUP * TILE]);
        // SAFETY: as in `q4_k_group`.
        unsafe { T::begin(q8_0_config()) };
        for gt in 0..tile.tiles() {
            let qs = tile.qs[gt * dwords * TILE * 4..].as_ptr();
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut b = 0;
            while b < blocks {
                let four = blocks - b >= 4;
                // SAFETY: weight tiles read rows r < 8 of 32 bytes at r * cols + 32 * (b + i):
                // within GROUP * cols bytes of q (unpacked); token tiles 8 rows of 32 bytes from
                // dword 8 * (b + i) of tile `gt`: within its dwords * 32 bytes (asserted), for
                // i < 4 where `four` (b + 4 <= blocks) and i = 0 otherwise; the stores into `c`.
                unsafe {
                    let (a, y, o) = (t.q.as_ptr().add(32 * b), qs.add(8 * b * TILE * 4), c.0.as_mut_ptr());
                    if four {
                        T::q8_0_blocks::<4>(a, cols, y, o)
                    } else {
                        T::q8_0_blocks::<1>(a, cols, y, o)
                    }
                }
                for i in 0..if four { 4 } else { 1 } {
                    // SAFETY: 8 floats at (gt * blocks + b + i) * TILE + 8 <= tile.d.len()
                    // (asserted, b + i < blocks).
                    let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((gt * blocks + b + i) * TILE)) };
                    let da = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(da), da);
                    for (p, acc) in acc.iter_mut().enumerate() {
                        let (r0, r1) = (GROUP * (b + i) + 2 * p, GROUP * (b + i) + 2 * p + 1);
                        let dd = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(t.d[r0]), _mm512_set1_ps(t.d[r1]));
                        // SAFETY: 16 aligned i32 at i * GROUP * TILE + 16p < 4 * GROUP * TILE.
                        let s = unsafe { _mm512_load_si512(c.0.as_ptr().add(i * GROUP * TILE + 16 * p) as *const _) };
                        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dd, da), *acc);
                    }
                }
                b += if four { 4 } else { 1 };
            }
            store_pairs(&acc, out, n, gt);
        }
        // SAFETY: releases the tiles this call configured.
        unsafe { T::end() };
    });
}

/// Row pairs' sums of token tile `gt` (row `2p` in the low eight lanes of `v[p]`, `2p + 1`
/// in the high) into `out[r * n + t]`.
#[target_feature(enable = "avx512f")]
fn store_pairs(v: &[__m512; GROUP / 2], out: &mut [f32], n: usize, gt: usize) {
    let k = TILE.min(n - gt * TILE);
    for (p, v) in v.iter().enumerate() {
        let mut a = [0f32; 16];
        // SAFETY: 16 floats into a 16-float array.
        unsafe { _mm512_storeu_ps(a.as_mut_ptr(), *v) };
        for h in 0..2 {
            let r = 2 * p + h;
            out[r * n + gt * TILE..r * n + gt * TILE + k].copy_from_slice(&a[8 * h..8 * h + k]);
        }
    }
}

/// [`q4_k_group`] or [`q8_0_group`] on the scalar tile operations, for tests on any CPU with
/// the AVX-512 features the rest of the kernel uses; `false` (nothing run) without them or for
/// another format.
#[cfg(test)]
pub(crate) fn emulated(f: smoe_quant::Format, w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) -> bool {
    let cpu = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq");
    // SAFETY: the features checked just above; `Emulated` needs no AMX.
    unsafe {
        match f {
            smoe_quant::Format::Q4_K if cpu => q4_k_tiles::<Emulated>(w, tile, out),
            smoe_quant::Format::Q8_0 if cpu => q8_0_tiles::<Emulated>(w, tile, out),
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulation with one sum off by one (the kind of slip a misread operand gives).
    struct OffByOne;

    impl Tiles for OffByOne {
        unsafe fn begin(_: &TileConfig) {}

        unsafe fn end() {}

        unsafe fn q4_k_superblock(w: [*const u8; 3], ws: usize, b: *const i8, c: *mut i32) {
            // SAFETY: as the caller guarantees.
            unsafe {
                Emulated::q4_k_superblock(w, ws, b, c);
                *c.add(64 + 9) += 1;
            }
        }

        unsafe fn q8_0_blocks<const N: usize>(a: *const i8, ws: usize, y: *const i8, c: *mut i32) {
            // SAFETY: as the caller guarantees.
            unsafe { Emulated::q8_0_blocks::<N>(a, ws, y, c) }
        }
    }

    /// The start-up check passes identical tile operations and catches one wrong sum; where
    /// the CPU offers AMX, `usable()` has run it on the instructions themselves.
    #[test]
    fn the_start_up_check_compares_the_instructions_with_their_definition() {
        // SAFETY: neither side uses AMX.
        unsafe {
            assert!(tiles_agree::<Emulated, Emulated>(7));
            assert!(!tiles_agree::<Emulated, OffByOne>(7));
        }
        let leaf7 = __cpuid_count(7, 0);
        if (leaf7.edx >> 24) & 3 == 3 && std::env::var_os("SMOE_AMX").is_none() {
            assert!(usable(), "this CPU has AMX-TILE and AMX-INT8, but the tiles were refused or disagree");
        }
    }
}
