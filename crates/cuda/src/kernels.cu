// The CUDA backend's kernels, compiled at run time by NVRTC for the device's architecture.
//
// Weights stay in ggml's block formats in VRAM (the bytes of the vault or GGUF, unchanged):
// every product decodes 32 values at a time with `group<F>` (one block of a simple format, a
// sub-block of a K-quant's 256) and multiplies in f32. Format numbers are smoe_quant::Format's.
// Pointers arrive as 64-bit integers from Rust; every kernel bounds its own indices.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// The first statement of every kernel (see launch.rs): wait until the kernel before this one in
// the stream has finished and its writes are visible, then let the one after be scheduled.
// Before compute 9.0 kernels are launched without overlap and this is empty.
#if __CUDA_ARCH__ >= 900
#define PDL_START asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_START
#endif

// Asks L2 for bytes [p, p + bytes) (one bulk request of the copy engine, from the calling thread),
// where prefetching pays: mostly weights, which no kernel writes, and cache rows of earlier
// steps. Called before PDL_START, it overlaps their fetch with the kernel before; after it,
// with the kernel's own first loads. Only a hint: L2 stays coherent, so a prefetch of rows the
// kernel before is still writing only wastes the request, and changes no result. Compute 9.0
// and up (cp.async.bulk.prefetch; kernels before it do not overlap, so there it is nothing).
__device__ __forceinline__ void prefetch_l2(const void* p, u64 bytes) {
#if __CUDA_ARCH__ >= 900
    // The request wants 16-byte alignment and length: the ends' few bytes are left out.
    u64 a = ((u64)p + 15) & ~15ull, e = ((u64)p + bytes) & ~15ull;
    if (e > a) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((u32)(e - a)) : "memory");
#endif
}

// Half-precision values lie at even offsets in every format (scales included), so one 16-bit
// load reads them.
__device__ __forceinline__ float half_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float f16(const u8* p) { return half_bits(*(const u16*)p); }

__device__ __forceinline__ float bf16(const u8* p) {
    return __uint_as_float((u32)(*(const u16*)p) << 16);
}

// A small integer (|v| < 2^22) as f32, exactly: v added to the bits of 1.5 * 2^23 (whose unit in
// the last place is 1), then 1.5 * 2^23 taken away. An integer add and a float add at full rate
// instead of a conversion, which the SMs run at a quarter rate: decoding a quantized weight is
// one conversion per value, and at that rate the conversions bounded the decode products.
__device__ __forceinline__ float itof(int v) {
    return __int_as_float(0x4B400000 + v) - 12582912.0f;
}

// `words` little-endian 32-bit words from 2-byte aligned p, by 16-bit loads: a lane reading a
// block's quants as words instead of bytes issues a quarter (or half) of the loads, which the
// decode products are short of (shared memory serves one load instruction per cycle).
__device__ __forceinline__ void load_u16(const u8* p, u32* w, int words) {
    const u16* h = (const u16*)p;
#pragma unroll
    for (int k = 0; k < words; k++) w[k] = (u32)h[2 * k] | ((u32)h[2 * k + 1] << 16);
}

// 32 bytes from p (2-byte aligned) as eight words, with 16-byte loads where p is 16-aligned:
// for formats whose quants always are (Q4_K, Q5_K), so that a warp's lanes agree.
__device__ __forceinline__ void load32(const u8* p, u32* w) {
    if (((size_t)p & 15) == 0) {
        uint4 a = ((const uint4*)p)[0], b = ((const uint4*)p)[1];
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else {
        load_u16(p, w, 8);
    }
}

// Byte l of words w (l a compile-time constant after unrolling, so w stays in registers).
#define BYTE(w, l) (((w)[(l) >> 2] >> (8 * ((l) & 3))) & 0xFF)

// Q4_K / Q5_K: 6-bit scale and minimum of sub-block j from the 12 packed bytes, byte(l) giving
// byte l (from memory, or from words already in registers). By selects, not a branch on
// j < 4: where j is known only at run time, a branch between two tasks' decodes kept the
// compiler from issuing the later task's loads before the earlier one's sums.
template <class Byte>
__device__ __forceinline__ void scale_min_k4_of(int j, Byte byte, float* sc, float* mn) {
    u32 bj = byte(j), b4 = byte(j + 4), lo = byte(j & 3);  // lo: byte j - 4 where j >= 4
    bool first = j < 4;
    *sc = (float)(first ? bj & 63 : (b4 & 0xF) | ((lo >> 6) << 4));
    *mn = (float)(first ? b4 & 63 : (b4 >> 4) | ((bj >> 6) << 4));
}
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* mn) {
    scale_min_k4_of(j, [q](int l) { return (u32)q[l]; }, sc, mn);
}

// Q3_K: signed 6-bit scale s (of 16) from the 12 packed bytes.
__device__ __forceinline__ float scale_q3_k(int s, const u8* sc) {
    int lo = s < 8 ? (sc[s] & 0xF) : (sc[s - 8] >> 4);
    int hi = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    return (float)((lo | (hi << 4)) - 32);
}

// Half the e8m0 scale 2^(e - 127), exactly (subnormal for e 0 and 1), as the CPU's
// e8m0_to_f32_half: MXFP4's codes are doubled e2m1 values.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// The doubled e2m1 value of an MXFP4 code (ggml's kvalues_mxfp4: 0 1 2 3 4 6 8 12, sign in bit
// 3), from a table of nibbles held in one word.
__device__ __forceinline__ float mxfp4_value(u32 q) {
    float v = itof((int)((0xC8643210u >> (4 * (q & 7))) & 0xF));
    return q & 8 ? -v : v;
}

// A float8 e4m3 code's value (NaN for 0x7f and 0xff), as the CPU's e4m3_to_f32: the code times
// 512 is an integer (subnormals m, above (8 + m) << (e - 1)), divided by 512 exactly.
__device__ __forceinline__ float e4m3_value(u32 q) {
    if ((q & 0x7F) == 0x7F) return __uint_as_float(0x7FC00000u);
    int e = (q >> 3) & 15, m = q & 7;
    int v = e == 0 ? m : (8 + m) << (e - 1);
    return (float)(q & 0x80 ? -v : v) / 512.0f;
}

// Whether rows of format F may end inside a group of 32 (only the float formats).
#define PARTIAL(F) ((F) == 0 || (F) == 1 || (F) == 30)

// Values 32g .. 32g + 32 of a row of `cols` in format F into y (zeros past the row's end, which
// only the float formats can have).
template <int F>
__device__ __forceinline__ void group(const u8* row, int g, int cols, float* y) {
    if (PARTIAL(F)) {
        int lim = min(32, cols - 32 * g);
#pragma unroll
        for (int i = 0; i < 32; i++) {
            int c = 32 * g + i;
            if (i < lim) {
                if (F == 0) y[i] = ((const float*)row)[c];
                else if (F == 1) y[i] = f16(row + 2 * c);
                else y[i] = bf16(row + 2 * c);
            } else {
                y[i] = 0.0f;
            }
        }
    } else if (F == 2) {  // Q4_0
        const u8* b = row + (size_t)g * 18;
        float d = f16(b);
        u32 w[4];
        load_u16(b + 2, w, 4);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            y[i] = itof((int)(BYTE(w, i) & 0xF) - 8) * d;
            y[i + 16] = itof((int)(BYTE(w, i) >> 4) - 8) * d;
        }
    } else if (F == 3) {  // Q4_1
        const u8* b = row + (size_t)g * 20;
        float d = f16(b), m = f16(b + 2);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            y[i] = itof(b[4 + i] & 0xF) * d + m;
            y[i + 16] = itof(b[4 + i] >> 4) * d + m;
        }
    } else if (F == 6 || F == 7) {  // Q5_0, Q5_1
        const u8* b = row + (size_t)g * (F == 6 ? 22 : 24);
        float d = f16(b), m = F == 7 ? f16(b + 2) : 0.0f;
        const u8* h = b + (F == 6 ? 2 : 4);
        u32 qh = (u32)h[0] | ((u32)h[1] << 8) | ((u32)h[2] << 16) | ((u32)h[3] << 24);
        const u8* qs = h + 4;
        int off = F == 6 ? 16 : 0;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int x0 = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
            int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
            y[j] = itof(x0 - off) * d + m;
            y[j + 16] = itof(x1 - off) * d + m;
        }
    } else if (F == 8) {  // Q8_0
        const u8* b = row + (size_t)g * 34;
        float d = f16(b);
        u32 w[8];
        load_u16(b + 2, w, 8);
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = itof((int)(w[i >> 2] << (24 - 8 * (i & 3))) >> 24) * d;
    } else if (F == 10) {  // Q2_K: 16 scale bytes, 64 quant bytes, d, dmin
        int sub = g & 7;
        const u8* b = row + (size_t)(g >> 3) * 84;
        float d = f16(b + 80), dmin = f16(b + 82);
        const u8* q = b + 16 + 32 * (sub >> 2);
        int shift = 2 * (sub & 3);
        u8 s0 = b[2 * sub], s1 = b[2 * sub + 1];
        float d0 = d * (float)(s0 & 0xF), m0 = dmin * (float)(s0 >> 4);
        float d1 = d * (float)(s1 & 0xF), m1 = dmin * (float)(s1 >> 4);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            y[l] = d0 * itof((q[l] >> shift) & 3) - m0;
            y[l + 16] = d1 * itof((q[l + 16] >> shift) & 3) - m1;
        }
    } else if (F == 11) {  // Q3_K: 32 hmask bytes, 64 quant bytes, 12 scale bytes, d
        int sub = g & 7;
        const u8* b = row + (size_t)(g >> 3) * 110;
        const u8* hm = b;
        const u8* q = b + 32 + 32 * (sub >> 2);
        float d = f16(b + 108);
        int shift = 2 * (sub & 3);
        u8 m = (u8)(1 << sub);
        float d0 = d * scale_q3_k(2 * sub, b + 96), d1 = d * scale_q3_k(2 * sub + 1, b + 96);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            y[l] = d0 * itof(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            y[l + 16] = d1 * itof(((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
        }
    } else if (F == 12 || F == 13) {  // Q4_K, Q5_K: d, dmin, 12 scale bytes, [32 high bits,] quants
        int sub = g & 7;
        const u8* b = row + (size_t)(g >> 3) * (F == 12 ? 144 : 176);
        float d = f16(b), dmin = f16(b + 2), sc, mn;
        scale_min_k4(sub, b + 4, &sc, &mn);
        float dl = d * sc, ml = dmin * mn;
        u32 w[8], h[8];
        load32(b + (F == 12 ? 16 : 48) + 32 * (sub >> 1), w);
        if (F == 13) load32(b + 16, h);
        int shift = 4 * (sub & 1);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = (BYTE(w, l) >> shift) & 0xF;
            if (F == 13) v += (BYTE(h, l) >> sub) & 1 ? 16 : 0;
            y[l] = dl * itof(v) - ml;
        }
    } else if (F == 39) {  // MXFP4: an e8m0 exponent, then 16 bytes of e2m1 codes (low nibbles first)
        // Byte loads only: 17-byte blocks leave every other one at an odd address.
        const u8* b = row + (size_t)g * 17;
        float d = e8m0_half(b[0]);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 q = b[1 + i];
            y[i] = mxfp4_value(q & 0xF) * d;
            y[i + 16] = mxfp4_value(q >> 4) * d;
        }
    } else if (F == 200) {  // MXFP8: an e8m0 exponent, then 32 float8 e4m3 codes
        const u8* b = row + (size_t)g * 33;
        float d = 2.0f * e8m0_half(b[0]);
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = e4m3_value(b[1 + i]) * d;
    } else if (F == 201) {  // FP8: an f32 scale (4 bytes, little-endian), then 128 float8 e4m3 codes
        const u8* b = row + (size_t)(g >> 2) * 132;
        float d = __uint_as_float((u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24));
        const u8* q = b + 4 + 32 * (g & 3);
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = e4m3_value(q[i]) * d;
    } else if (F == 14) {  // Q6_K: 128 low-nibble bytes, 64 high-bit bytes, 16 scales, d
        int sub = g & 7, n = sub >> 2, k = sub & 3;
        const u8* b = row + (size_t)(g >> 3) * 210;
        float d = f16(b + 208);
        const signed char* sc = (const signed char*)(b + 192 + 8 * n + 2 * k);
        float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
        u32 wl[8], wh[8];
        load_u16(b + 64 * n + (k & 1) * 32, wl, 8);
        load_u16(b + 128 + 32 * n, wh, 8);
        int shift = k >= 2 ? 4 : 0;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int lo = (BYTE(wl, l) >> shift) & 0xF;
            int q = (int)(lo | (((BYTE(wh, l) >> (2 * k)) & 3) << 4)) - 32;
            y[l] = (l < 16 ? d0 : d1) * itof(q);
        }
    }
}

// One product of a batch: rows of w (row_bytes apart) times input rows x_row.. into output rows
// out_row.. at column out_col.
struct Job {
    u64 w;
    u64 row_bytes;
    int rows, cols, x_row, n, out_row, out_col;
};

// Passed by value as a kernel parameter (at most 4 KiB of them): no copy before a launch.
#define MAX_JOBS 48
struct Jobs {
    int count;
    int prefetch;  // nonzero: each block asks L2 for its weight rows before it waits (PDL)
    Job job[MAX_JOBS];
};

// The sequences of a batched step's attention (qk_rope_store_seqs, attention_seqs): each one's
// keys and values (position p at row p), the position of its first query, its first row of the
// step and its rows (queries), and, for attention, the first position its first query sees,
// the positions per split and its splits (1: unsplit). In ascending rows.
#define MAX_SEQS 64
struct SeqKv {
    u64 k, v;
    int pos0, row, n, first, split, splits;
};
struct SeqKvs {
    int count, max_splits;
    SeqKv s[MAX_SEQS];
};

// The sequence that row t of the step belongs to.
__device__ __forceinline__ int seq_of(const SeqKvs& ss, int t) {
    int i = 0;
    while (i + 1 < ss.count && t >= ss.s[i].row + ss.s[i].n) i++;
    return i;
}

// Bytes of 32 consecutive groups (1024 values) of format F: the span a warp stages at once.
template <int F>
__device__ constexpr int span32() {
    return F == 0 ? 4096
         : (F == 1 || F == 30) ? 2048
         : F == 2 ? 32 * 18
         : F == 3 ? 32 * 20
         : F == 6 ? 32 * 22
         : F == 7 ? 32 * 24
         : F == 8 ? 32 * 34
         : F == 10 ? 4 * 84
         : F == 11 ? 4 * 110
         : F == 12 ? 4 * 144
         : F == 13 ? 4 * 176
         : F == 39 ? 32 * 17
         : F == 200 ? 32 * 33
         : F == 201 ? 8 * 132
         : 4 * 210;  // 14: Q6_K
}

// Starts copying `bytes` from global `src` into shared `dst` with the widest loads their
// alignment allows. From compute 8.0 the copies are asynchronous (cp.async: no registers
// held, the warp goes on decoding the previous span while they land; `mv_wait` waits);
// before that, and for spans only 2-byte (or byte) aligned, they are plain loads.
__device__ __forceinline__ void mv_fetch(u8* dst, const u8* src, int bytes, int lane) {
#if __CUDA_ARCH__ >= 800
    u32 d = (u32)__cvta_generic_to_shared(dst);
    if ((((size_t)src | bytes) & 15) == 0) {
        for (int i = lane; i < bytes / 16; i += 32)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + 16 * i), "l"(src + 16 * i));
        asm volatile("cp.async.commit_group;");
        return;
    }
    if ((((size_t)src | bytes) & 3) == 0) {
        for (int i = lane; i < bytes / 4; i += 32)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d + 4 * i), "l"(src + 4 * i));
        asm volatile("cp.async.commit_group;");
        return;
    }
    asm volatile("cp.async.commit_group;");  // an empty group keeps the count of groups uniform
#else
    if ((((size_t)src | bytes) & 15) == 0) {
        for (int i = lane; i < bytes / 16; i += 32) ((uint4*)dst)[i] = ((const uint4*)src)[i];
        return;
    }
    if ((((size_t)src | bytes) & 3) == 0) {
        for (int i = lane; i < bytes / 4; i += 32) ((u32*)dst)[i] = ((const u32*)src)[i];
        return;
    }
#endif
    if ((((size_t)src | bytes) & 1) == 0) {
        for (int i = lane; i < bytes / 2; i += 32) ((u16*)dst)[i] = ((const u16*)src)[i];
        return;
    }
    // Rows of an odd number of 17- or 33-byte blocks (MXFP4, MXFP8) start at odd addresses.
    for (int i = lane; i < bytes; i += 32) dst[i] = src[i];
}

// Waits until at most `pending` of this thread's fetches are still in flight, then for the
// whole warp (each lane copied part of every span).
template <int pending>
__device__ __forceinline__ void mv_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(pending));
#endif
    __syncwarp();
}

// Spans of format F a warp keeps in flight: about 4 KiB of its row (at least two spans), so
// that each warp has several loads outstanding, not one span's.
template <int F>
__device__ constexpr int mv_ring() {
    return span32<F>() >= 2048 ? 2 : (4096 / span32<F>() > 8 ? 8 : 4096 / span32<F>());
}

// Few tokens (decode): one warp per weight row, four rows per block. The warp stages 32 groups
// of the row at a time in shared memory with wide, coalesced copies (blocks are only 2-byte
// aligned, and a lane reading its own block byte by byte left the H200 at a fraction of its
// bandwidth), keeping the next few spans in flight while it decodes this one (a ring of
// `mv_ring` spans); each lane decodes one group from there and multiplies it with up to NT
// tokens. NT is 1 for a single token: eight accumulators and their loops held 94 registers per
// thread, which let only a quarter of the warps an SM can hold run, and with one span in flight
// per warp, too few loads were outstanding to keep HBM busy. Grid (row blocks of 4, jobs).
#define MV_TOKENS 8
#define MV_WARPS 4
template <int F, int NT>
__device__ void mv(const Job& j, const float* x, int xs, float* out, int os) {
    constexpr int SPAN = span32<F>(), RING = mv_ring<F>();
    __shared__ __align__(16) u8 stage[MV_WARPS][RING][SPAN];
    // One token's input for the span, shared by the block's rows, one group per 33 floats: lane
    // l reads value i of its group at l * 33 + i, a different bank for every lane. Read from
    // global memory, each lane's 16-byte loads hit a 128-byte line of their own, and those
    // loads, not the weights, bounded the products (their time did not change with the bytes
    // of the format).
    __shared__ float xg[NT == 1 ? 32 * 33 : 1];
    if (blockIdx.x * MV_WARPS >= j.rows) return;  // the whole block: no one left to sync with
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int r = blockIdx.x * MV_WARPS + warp;
    bool live = r < j.rows;  // a warp past the last row still stages input for the others
    const u8* row = (const u8*)j.w + (size_t)(live ? r : 0) * j.row_bytes;
    const float* xr = x + (size_t)j.x_row * xs;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    int groups = (j.cols + 31) / 32, spans = (groups + 31) / 32;
    float y[32];
    // Span c goes to slot c % RING; every step commits one group of copies (empty past the
    // row's end), so "all but RING - 1 groups done" means span c has landed.
#pragma unroll
    for (int c = 0; c < RING - 1; c++) {
        size_t at = (size_t)c * SPAN;
        mv_fetch(stage[warp][c], row + at, live && c < spans ? min(SPAN, (int)(j.row_bytes - at)) : 0, lane);
    }
    for (int c = 0; c < spans; c++) {
        int next = c + RING - 1;
        size_t at = (size_t)next * SPAN;
        mv_fetch(stage[warp][next % RING], row + at, live && next < spans ? min(SPAN, (int)(j.row_bytes - at)) : 0, lane);
        if (NT == 1) {
            __syncthreads();  // everyone is done with the previous span's input
            for (int e = threadIdx.x; e < 1024; e += 32 * MV_WARPS) {
                int col = 1024 * c + e;
                xg[(e / 32) * 33 + e % 32] = col < j.cols ? xr[col] : 0.0f;
            }
            __syncthreads();
        }
        mv_wait<RING - 1>();
        int g = 32 * c + lane;
        if (live && g < groups) {
            group<F>(stage[warp][c % RING], lane, j.cols - 1024 * c, y);
            if (NT == 1) {
                // Summed in the order of the many-token branch below, so that a token's result
                // does not depend on which kernel its batch got (zeros past the row's end on
                // both sides: no bound to check).
                const float* xv = xg + lane * 33;
                float s = 0.0f;
                if (!PARTIAL(F) && ((size_t)(xr + 32 * g) & 15) == 0) {
#pragma unroll
                    for (int i = 0; i < 32; i += 4) s += y[i] * xv[i] + y[i + 1] * xv[i + 1] + y[i + 2] * xv[i + 2] + y[i + 3] * xv[i + 3];
                } else {
#pragma unroll
                    for (int i = 0; i < 32; i++) s += y[i] * xv[i];
                }
                acc[0] += s;
            } else {
                int lim = min(32, j.cols - 32 * g);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < j.n) {
                        const float* xv = xr + (size_t)t * xs + 32 * g;
                        float s = 0.0f;
                        if (!PARTIAL(F) && ((size_t)xv & 15) == 0) {
                            // Aligned input rows (every row of a stride that is a multiple of 4): 16-byte loads.
#pragma unroll
                            for (int i = 0; i < 32; i += 4) {
                                float4 v = *(const float4*)(xv + i);
                                s += y[i] * v.x + y[i + 1] * v.y + y[i + 2] * v.z + y[i + 3] * v.w;
                            }
                        } else {
#pragma unroll
                            for (int i = 0; i < 32; i++)
                                if (!PARTIAL(F) || i < lim) s += y[i] * xv[i];
                        }
                        acc[t] += s;
                    }
                }
            }
        }
        __syncwarp();  // the slot just read is refilled by the next step
    }
    if (!live) return;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float a = acc[t];
        for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(0xffffffff, a, o);
        if (lane == 0 && t < j.n) out[(size_t)(j.out_row + t) * os + j.out_col + r] = a;
    }
}

// Many tokens (prefill): tiles of 64 weight rows by 32 tokens, 256 threads; 64 threads decode a
// group of each row into shared memory, all multiply; grid (row tiles, token tiles, jobs).
template <int F>
__device__ void mm(const Jobs& js, const float* x, int xs, float* out, int os) {
    __shared__ float ws[64][33];
    __shared__ float xt[32][33];
    const Job& j = js.job[blockIdx.z];
    int r0 = blockIdx.x * 64, t0 = blockIdx.y * 32;
    if (r0 >= j.rows || t0 >= j.n) return;
    int tid = threadIdx.x, tr = tid % 64, tq = tid / 64;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    int groups = (j.cols + 31) / 32;
    const float* xr = x + (size_t)(j.x_row + t0) * xs;
    for (int g = 0; g < groups; g++) {
        if (tid < 64) {
            float y[32];
            if (r0 + tid < j.rows) group<F>((const u8*)j.w + (size_t)(r0 + tid) * j.row_bytes, g, j.cols, y);
            else {
#pragma unroll
                for (int i = 0; i < 32; i++) y[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 32; i++) ws[tid][i] = y[i];
        }
        for (int e = tid; e < 32 * 32; e += 256) {
            int t = e / 32, c = e % 32, col = 32 * g + c;
            xt[t][c] = (t0 + t < j.n && col < j.cols) ? xr[(size_t)t * xs + col] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < 32; k++) {
            float w = ws[tr][k];
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] += w * xt[tq * 8 + i][k];
        }
        __syncthreads();
    }
    int r = r0 + tr;
    if (r < j.rows) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int t = t0 + tq * 8 + i;
            if (t < j.n) out[(size_t)(j.out_row + t) * os + j.out_col + r] = acc[i];
        }
    }
}

#if __CUDA_ARCH__ >= 800
// f32 as a tf32 value (the top 19 bits, rounded half away from zero) and what it leaves out,
// exact in f32. The tensor cores read a .tf32 operand's top 19 bits and ignore the rest, so
// the remainder goes in as it is (truncated there: at most 2^-21 of v lost). Three
// instructions: two cvt.rna.tf32 took nine (their SASS also handles infinities and NaNs, which
// these finite products never see), and in the prefill attention, which splits every key and
// value a warp reads, those were most of the instructions issued.
__device__ __forceinline__ void split_tf32(float v, u32* big, u32* small) {
    u32 b = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    *big = b;
    *small = __float_as_uint(v - __uint_as_float(b));
}

__device__ __forceinline__ void mma_tf32(float* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Asynchronous copies into shared memory (compute 8.0 and later). Staging a tile with plain
// loads, each thread's loop of load-then-store waited out one round trip to L2 per element (the
// loop's bounds are known only at run time, so nothing was hoisted): a dozen trips a step. These
// are issued together and waited for once. `live` false: the bytes are zeros and nothing is
// read (`src` must still be a valid address).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool live) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(live ? 16 : 0) : "memory");
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool live) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(live ? 4 : 0) : "memory");
}
// Waits for every copy this thread issued (a __syncthreads after it publishes them to the block).
__device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}
#endif

// A warp's m16n8 accumulators of NJ tiles of eight tokens into job j's output: c[jn] holds rows
// ra and ra + 8 for tokens t and t + 1 (t = t0 + 8 jn; ra and t0 already offset by the lane's
// place in the fragment), rows and tokens past the job's left out.
template <int NJ>
__device__ __forceinline__ void store_tile(const Job& j, int ra, int t0, const float (*c)[4], float* out, int os) {
    int rb = ra + 8;
#pragma unroll
    for (int jn = 0; jn < NJ; jn++) {
        int t = t0 + 8 * jn;
        if (ra < j.rows) {
            if (t < j.n) out[(size_t)(j.out_row + t) * os + j.out_col + ra] = c[jn][0];
            if (t + 1 < j.n) out[(size_t)(j.out_row + t + 1) * os + j.out_col + ra] = c[jn][1];
        }
        if (rb < j.rows) {
            if (t < j.n) out[(size_t)(j.out_row + t) * os + j.out_col + rb] = c[jn][2];
            if (t + 1 < j.n) out[(size_t)(j.out_row + t + 1) * os + j.out_col + rb] = c[jn][3];
        }
    }
}

// Many tokens on tensor cores (compute 8.0 and later): tiles of 64 weight rows by 64 tokens
// (each decoded weight group serves twice the tokens of `mm`'s tile), 128 threads, 64 input
// values per step, each warp 16 rows by 64 tokens as eight m16n8k8 TF32 products. Each f32 operand is split into a TF32 value and its TF32 remainder and
// three products are summed (big·big + big·small + small·big), which keeps f32 accuracy
// ("3xTF32") at a third of the tensor cores' TF32 rate.
// Job jb over groups g_lo .. g_hi of its rows (g_lo even): the whole row, or one slice of a
// split product (`mmt_split_f32`).
template <int F>
__device__ void mm_tc(const Jobs& js, int jb, int g_lo, int g_hi, const float* x, int xs, float* out, int os) {
#if __CUDA_ARCH__ >= 800
    __shared__ float ws[64][68];
    __shared__ float xt[64][68];
    const Job& j = js.job[jb];
    int r0 = blockIdx.x * 64, t0 = blockIdx.y * 64;
    if (r0 >= j.rows || t0 >= j.n) return;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    float c[8][4];
#pragma unroll
    for (int a = 0; a < 8; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) c[a][b] = 0.0f;
    int groups = min((j.cols + 31) / 32, g_hi);
    const float* xr = x + (size_t)(j.x_row + t0) * xs;
    for (int g0 = g_lo; g0 < groups; g0 += 2) {
        {
            int r = tid % 64, half = tid / 64, gg = g0 + half;
            float y[32];
            if (r0 + r < j.rows && gg < groups) group<F>((const u8*)j.w + (size_t)(r0 + r) * j.row_bytes, gg, j.cols, y);
            else {
#pragma unroll
                for (int i = 0; i < 32; i++) y[i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 32; i++) ws[r][32 * half + i] = y[i];
        }
        for (int e = tid; e < 64 * 64; e += 128) {
            int t = e / 64, cc = e % 64, col = 32 * g0 + cc;
            xt[t][cc] = (t0 + t < j.n && col < j.cols) ? xr[(size_t)t * xs + col] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k0 = 0; k0 < 64; k0 += 8) {
            u32 ab[4], as[4];
            int ra = 16 * warp + gid;
            split_tf32(ws[ra][k0 + tig], &ab[0], &as[0]);
            split_tf32(ws[ra + 8][k0 + tig], &ab[1], &as[1]);
            split_tf32(ws[ra][k0 + tig + 4], &ab[2], &as[2]);
            split_tf32(ws[ra + 8][k0 + tig + 4], &ab[3], &as[3]);
#pragma unroll
            for (int jn = 0; jn < 8; jn++) {
                u32 bb[2], bs[2];
                split_tf32(xt[8 * jn + gid][k0 + tig], &bb[0], &bs[0]);
                split_tf32(xt[8 * jn + gid][k0 + tig + 4], &bb[1], &bs[1]);
                mma_tf32(c[jn], as, bb);
                mma_tf32(c[jn], ab, bs);
                mma_tf32(c[jn], ab, bb);
            }
        }
        __syncthreads();
    }
    store_tile<8>(j, r0 + 16 * warp + gid, t0 + 2 * tig, c, out, os);
#endif
}

// Embedding rows: one block per token, threads over groups.
template <int F>
__device__ void embed(const u8* table, u64 row_bytes, int cols, const int* ids, float* out) {
    const u8* row = table + (size_t)ids[blockIdx.x] * row_bytes;
    float y[32];
    for (int g = threadIdx.x; g < (cols + 31) / 32; g += blockDim.x) {
        group<F>(row, g, cols, y);
        int lim = min(32, cols - 32 * g);
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (i < lim) out[(size_t)blockIdx.x * cols + 32 * g + i] = y[i];
    }
}

// Transposed product: out[t, c] = sum_r w[r, c] x[t * xs + r] over m rows; one thread per
// (token, group of 32 columns).
template <int F>
__device__ void mt(const u8* w, u64 row_bytes, int m, int cols, const float* x, int xs, int n, float* out) {
    int groups = (cols + 31) / 32;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * groups) return;
    int t = i / groups, g = i % groups;
    float acc[32], y[32];
#pragma unroll
    for (int k = 0; k < 32; k++) acc[k] = 0.0f;
    for (int r = 0; r < m; r++) {
        group<F>(w + (size_t)r * row_bytes, g, cols, y);
        float xv = x[(size_t)t * xs + r];
#pragma unroll
        for (int k = 0; k < 32; k++) acc[k] += y[k] * xv;
    }
    int lim = min(32, cols - 32 * g);
#pragma unroll
    for (int k = 0; k < 32; k++)
        if (k < lim) out[(size_t)t * cols + 32 * g + k] = acc[k];
}

// Products of the experts a layer keeps in VRAM, one (token, slot) pair and matrix per block
// row: `parts` matrices (gate and up, or down) of every expert back to back from `base`, the
// expert of each pair read from the routes on the device (`[n, 2k]`: ids as floats, then
// weights), so the host never learns them. Input row: the pair's token (`h`) or the pair
// itself (`gu`); output row: the pair.
struct Kept {
    u64 base[2];
    u64 expert_bytes[2];
    u64 row_bytes;
    int rows, cols, k, parts, experts, x_per_pair;
    int out_col[2];
};

// The product of this block's (token, slot) pair and matrix, as a job.
__device__ Job kept_job(const Kept& kp, const float* routes) {
    int pair = blockIdx.y / kp.parts, part = blockIdx.y % kp.parts;
    int t = pair / kp.k;
    float id = routes[(size_t)t * 2 * kp.k + pair % kp.k];
    int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;  // a NaN route reads expert 0, never outside
    Job j;
    j.w = kp.base[part] + (u64)e * kp.expert_bytes[part];
    j.row_bytes = kp.row_bytes;
    j.rows = kp.rows;
    j.cols = kp.cols;
    j.x_row = kp.x_per_pair ? pair : t;
    j.n = 1;
    j.out_row = pair;
    j.out_col = kp.out_col[part];
    return j;
}

template <int F>
__device__ void mv_kept(const Kept& kp, const float* routes, const float* x, int xs, float* out, int os) {
    mv<F, 1>(kept_job(kp, routes), x, xs, out, os);
}

// ---- Decode products on int8 activations (Precision::Fast) ----
//
// One token's input quantized per group of 32 to int8 (scale max|x| / 127, rounded to nearest,
// as the CPU's fast path does) and multiplied with the weights' own small integers four at a
// time (dp4a): a lane's 32 weights take a handful of instructions instead of a conversion and
// two multiplies each, and the f32 mat-vec above was bound by exactly those instructions (the
// SMs 64% busy at 9% of HBM bandwidth on 768 × 2048 Q4_K experts). The input rows are
// quantized once per launch by `quantize_rows` into a scratch buffer (quantizing them in every
// block cost more than the products: five times the instructions of a block's rows), each row
// `qstride` bytes: cols int8, then a float scale per group, then a float scale × sum of the
// group's integers. Each warp of a product takes MVQ_ROWS rows.
#define MVQ_WARPS 4
#define MVQ_ROWS 2

// Group g of a quantized row (`cols` values) from its 32 values, one per lane of a warp (all 32
// lanes call it): the int8 value at row[32g + lane], the group's scale and scale × sum after the
// row's cols bytes. Every kernel that quantizes (the fused norms, attention, SiLU) goes through
// here, so a fused kernel's int8 input has the bits `quantize_rows` would give its f32 output.
__device__ __forceinline__ void quantize_group(float v, u8* row, int cols, int g) {
    int lane = threadIdx.x % 32, groups = cols / 32;
    float a = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffff, a, o));
    float d = a / 127.0f;
    int q = a > 0.0f ? __float2int_rn(v / d) : 0;
    ((signed char*)row)[32 * g + lane] = (signed char)q;
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) {
        float* xd = (float*)(row + cols);
        xd[g] = d;
        xd[groups + g] = d * (float)sum;
    }
}

// Rows lo .. lo + rows of x (cols values each, a multiple of 32) into qx: one warp per group.
extern "C" __global__ void quantize_rows(const float* x, int xs, int lo, int rows, int cols, u8* qx, int qstride) { PDL_START;
    int groups = cols / 32;
    int gi = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (gi >= rows * groups) return;
    int r = gi / groups, g = gi % groups;
    quantize_group(x[(size_t)(lo + r) * xs + 32 * g + threadIdx.x % 32], qx + (size_t)r * qstride, cols, g);
}

__device__ __forceinline__ int load_i32_u16(const u8* p) {
    const u16* h = (const u16*)p;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

// Lane task t of a row of format F against the quantized input. Q8_0: group t (34 bytes: f16
// scale, 32 int8). Q4_K: pair t % 4 of super-block t / 4 (sub-blocks 2p and 2p + 1 share 32
// bytes of quants: low and high nibbles). Q6_K: pairs of groups too (see mvq_load<14>). In two
// halves: `mvq_load` reads the task's weights into registers and `mvq_dot` uses them, so that a
// kernel can issue several tasks' loads before it waits for any (see mvq_mix in kept.cu).
template <int F>
struct MvqW;
template <>
struct MvqW<8> {
    u16 d;
    int q[8];
};
template <>
struct MvqW<12> {
    uint4 h, qa, qb;  // the super-block's scales, the pair's low and high quants
};
template <>
struct MvqW<14> {
    int ql[8], qh[8];  // the pair's 32 bytes of low nibbles (both groups) and of high bits (all four)
    u16 sc0, sc1, d;   // the scales of the pair's first group's two halves, of its second's, and d
};

template <int F>
__device__ __forceinline__ MvqW<F> mvq_load(const u8* row, int t);
template <>
__device__ __forceinline__ MvqW<8> mvq_load<8>(const u8* row, int t) {
    const u8* b = row + (size_t)t * 34;
    MvqW<8> w;
    w.d = *(const u16*)b;
#pragma unroll
    for (int k = 0; k < 8; k++) w.q[k] = load_i32_u16(b + 2 + 4 * k);
    return w;
}
template <>
__device__ __forceinline__ MvqW<12> mvq_load<12>(const u8* row, int t) {
    const u8* b = row + (size_t)(t >> 2) * 144;
    int p = t & 3;
    return MvqW<12>{*(const uint4*)b, *(const uint4*)(b + 16 + 32 * p), *(const uint4*)(b + 32 + 32 * p)};
}
// Q6_K: pair p of super-block t / 4 is groups 4h + k and 4h + k + 2 (h = p / 2, k = p % 2): the
// low and high nibbles of the same 32 bytes of ql, with bits 2k and 2k + 4 of the half's 32
// bytes of qh on top. 210-byte super-blocks leave every other one only 2-byte aligned.
template <>
__device__ __forceinline__ MvqW<14> mvq_load<14>(const u8* row, int t) {
    const u8* b = row + (size_t)(t >> 2) * 210;
    int h = (t & 3) >> 1, k = t & 1;
    const u8 *ql = b + 64 * h + 32 * k, *qh = b + 128 + 32 * h, *sc = b + 192 + 8 * h + 2 * k;
    MvqW<14> w;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        w.ql[i] = load_i32_u16(ql + 4 * i);
        w.qh[i] = load_i32_u16(qh + 4 * i);
    }
    w.sc0 = *(const u16*)sc;
    w.sc1 = *(const u16*)(sc + 4);
    w.d = *(const u16*)(b + 208);
    return w;
}

// A Q8_0 group's term of a product: the weights' scale times the input's times their 32-bit
// sum s, the last product rounded on its own (never fused with the add that takes the term), so
// that kernels adding the same terms in the same order give the same bits whatever the compiler
// contracts (`mvq` and the few-token `mvqm_q8_0` on tensor cores).
__device__ __forceinline__ float q8_term(u16 d, float xd, int s) { return __fmul_rn(half_bits(d) * xd, (float)s); }

// A Q4_K pair's term: sub-blocks of scales sc0, sc1 and minimums mn0, mn1 against input groups
// of scales xd0, xd1 and sums xs0, xs1, their 32-bit sums s0, s1. Every multiply and fused
// multiply-add is spelled out, so that the one-token kernels and the few-token `mvqm_q4_k` on
// tensor cores round it alike whatever the compiler would contract (as q8_term).
__device__ __forceinline__ float q4k_term(float d, float dmin, float sc0, float mn0, float sc1, float mn1, float xd0, float xd1,
                                          float xs0, float xs1, int s0, int s1) {
    float v = __fmaf_rn(__fmul_rn(sc0, xd0), (float)s0, __fmul_rn(__fmul_rn(sc1, xd1), (float)s1));
    float m = __fmaf_rn(mn0, xs0, __fmul_rn(mn1, xs1));
    return __fmaf_rn(d, v, -__fmul_rn(dmin, m));
}

// The term of pair p of a Q4_K super-block whose first 16 bytes (d, dmin, the 12 packed scales
// and minimums) are h.
__device__ __forceinline__ float q4k_pair_term(uint4 h, int p, float xd0, float xd1, float xs0, float xs1, int s0, int s1) {
    // Byte l of the 12 packed scales (bytes 4-15 of the super-block), from registers.
    auto byte = [&h](int l) {
        u32 word = l < 4 ? h.y : l < 8 ? h.z : h.w;
        return (word >> (8 * (l & 3))) & 0xFF;
    };
    float sc0, mn0, sc1, mn1;
    scale_min_k4_of(2 * p, byte, &sc0, &mn0);
    scale_min_k4_of(2 * p + 1, byte, &sc1, &mn1);
    float d = half_bits((u16)(h.x & 0xFFFF)), dmin = half_bits((u16)(h.x >> 16));
    return q4k_term(d, dmin, sc0, mn0, sc1, mn1, xd0, xd1, xs0, xs1, s0, s1);
}

template <int F>
__device__ __forceinline__ float mvq_dot(const MvqW<F>& w, int t, const signed char* xq, const float* xd, const float* xs);
template <>
__device__ __forceinline__ float mvq_dot<8>(const MvqW<8>& w, int t, const signed char* xq, const float* xd, const float* xs) {
    const int4* xv = (const int4*)(xq + 32 * t);
    int4 xa = xv[0], xb = xv[1];
    int xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) s = __dp4a(w.q[k], xw[k], s);
    return q8_term(w.d, xd[t], s);
}
template <>
__device__ __forceinline__ float mvq_dot<12>(const MvqW<12>& w, int t, const signed char* xq, const float* xd, const float* xs) {
    int sb = t >> 2, p = t & 3;
    u32 q[8] = {w.qa.x, w.qa.y, w.qa.z, w.qa.w, w.qb.x, w.qb.y, w.qb.z, w.qb.w};
    int g0 = 8 * sb + 2 * p;
    const int4* x0 = (const int4*)(xq + 32 * g0);
    int4 xa = x0[0], xb = x0[1], xc = x0[2], xe = x0[3];
    int lo[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int hi[8] = {xc.x, xc.y, xc.z, xc.w, xe.x, xe.y, xe.z, xe.w};
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        s0 = __dp4a((int)(q[k] & 0x0F0F0F0F), lo[k], s0);
        s1 = __dp4a((int)((q[k] >> 4) & 0x0F0F0F0F), hi[k], s1);
    }
    return q4k_pair_term(w.h, p, xd[g0], xd[g0 + 1], xs[g0], xs[g0 + 1], s0, s1);
}

// Four Q6_K quants less 32, as the signed bytes dp4a and the tensor cores take: four low
// nibbles of `ql` (from bit `nibble` of each byte, 0 or 4) with two bits of `qh` on top (from
// bit `bits`), each six-bit value 0..63 less 32 byte by byte (two's complement bytes: -32..31).
// `mvq_dot<14>` and `mmq`'s decode both form their bytes here.
__device__ __forceinline__ u32 q6k_quads(u32 ql, u32 qh, int nibble, int bits) {
    return __vsub4(((ql >> nibble) & 0x0F0F0F0Fu) | (((qh >> bits) & 0x03030303u) << 4), 0x20202020u);
}

// A Q6_K pair's term: d times the input groups' scales xd0, xd1 times their integer sums i0, i1
// (each already weighted by its halves' 8-bit scales), every rounding spelled out as q8_term's.
__device__ __forceinline__ float q6k_term(u16 d, float xd0, float xd1, int i0, int i1) {
    return __fmul_rn(half_bits(d), __fmaf_rn(xd0, (float)i0, __fmul_rn(xd1, (float)i1)));
}

template <>
__device__ __forceinline__ float mvq_dot<14>(const MvqW<14>& w, int t, const signed char* xq, const float* xd, const float* xs) {
    int k = t & 1, g0 = 8 * (t >> 2) + 4 * ((t & 3) >> 1) + k, g1 = g0 + 2;
    const int4* x0 = (const int4*)(xq + 32 * g0);
    const int4* x1 = (const int4*)(xq + 32 * g1);
    int4 xa = x0[0], xb = x0[1], xc = x1[0], xe = x1[1];
    int lo[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int hi[8] = {xc.x, xc.y, xc.z, xc.w, xe.x, xe.y, xe.z, xe.w};
    int s[4] = {0, 0, 0, 0};  // the four halves of 16 values: group 0's two, group 1's two
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q0 = (int)q6k_quads((u32)w.ql[i], (u32)w.qh[i], 0, 2 * k);
        int q1 = (int)q6k_quads((u32)w.ql[i], (u32)w.qh[i], 4, 2 * k + 4);
        s[i / 4] = __dp4a(q0, lo[i], s[i / 4]);
        s[2 + i / 4] = __dp4a(q1, hi[i], s[2 + i / 4]);
    }
    int i0 = (int)(signed char)(w.sc0 & 0xFF) * s[0] + (int)(signed char)(w.sc0 >> 8) * s[1];
    int i1 = (int)(signed char)(w.sc1 & 0xFF) * s[2] + (int)(signed char)(w.sc1 >> 8) * s[3];
    return q6k_term(w.d, xd[g0], xd[g1], i0, i1);
}

template <int F>
__device__ __forceinline__ float mvq_task(const u8* row, int t, const signed char* xq, const float* xd, const float* xs) {
    return mvq_dot<F>(mvq_load<F>(row, t), t, xq, xd, xs);
}

// Lane tasks of a row of `cols` values (see mvq_load): Q8_0 groups of 32, Q4_K and Q6_K pairs
// of 64.
// `mvq_tasks` in backend.rs is the same function.
template <int F>
__device__ __forceinline__ int mvq_tasks(int cols) { return F == 8 ? cols / 32 : cols / 64; }

// Warps that share a pair of rows, each taking every split-th task: about one task per lane
// and row. A row of 4096 Q8_0 values is 128 tasks; with a warp per pair of rows the 2048-row
// output projection was 256 blocks of 4 warps, too few loads in flight to pass 0.9 TB/s.
// `mvq_split` in backend.rs is the same function: the grid depends on it.
template <int F>
__device__ __forceinline__ int mvq_split(int cols) {
    return mvq_tasks<F>(cols) >= 128 ? 4 : 1;  // 2 for 64 tasks (q/k/v from 2048) measured 13% slower
}

// Job j's rows against its N input rows (N = 1, or up to MV_TOKENS: `j.n` of them), token c's
// quantized at qx + (j.x_row + c - lo) * qstride. A warp takes MVQ_ROWS (2) rows: both at once,
// so that the loads of one are in flight while the other's arrive (one row after the other, a
// warp had a single task's loads outstanding), and for rows of at most 16 tasks (a down
// projection from 768: 12) half a warp each, which left 20 of 32 lanes idle as a warp per row.
// Long rows are split between `mvq_split` warps, whose partial sums are added in warp order
// (the same bits from run to run). A task's weights are loaded once for all N tokens, and each
// token's sum runs in the order it runs alone: a product of a few tokens gives each token the
// bits of its one-token product (N only unrolls the loops; with N = 1 the kernel keeps the
// registers of one accumulator per row). The tiles did these few-token products before: with
// one column of 64-row tiles, a decode step of four sequences' 2048-wide projections ran on
// 32-64 blocks, latency-bound.
template <int F, int N>
__device__ void mvq(const Job& j, const u8* qx, int qstride, int lo, float* out, int os) {
    __shared__ float partial[MVQ_WARPS][MVQ_ROWS][N];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int split = mvq_split<F>(j.cols), part = warp % split;
    int n = N == 1 ? 1 : j.n;
    const signed char* xq[N];
    const float *xd[N], *xsum[N];
#pragma unroll
    for (int c = 0; c < N; c++) {
        const u8* qrow = qx + (size_t)(j.x_row + (c < n ? c : 0) - lo) * qstride;
        xq[c] = (const signed char*)qrow;
        xd[c] = (const float*)(qrow + j.cols);
        xsum[c] = xd[c] + j.cols / 32;
    }
    int tasks = mvq_tasks<F>(j.cols);
    int r0 = (blockIdx.x * (MVQ_WARPS / split) + warp / split) * MVQ_ROWS;
    if (r0 >= j.rows) return;  // the whole warp, and the warps it shares rows with
    if (tasks <= 16) {
        int r = r0 + lane / 16, t = lane % 16;
        bool live = r < j.rows && t < tasks;
        MvqW<F> w;
        if (live) w = mvq_load<F>((const u8*)j.w + (size_t)r * j.row_bytes, t);
#pragma unroll
        for (int c = 0; c < N; c++) {
            if (c >= n) break;
            float acc = live ? mvq_dot<F>(w, t, xq[c], xd[c], xsum[c]) : 0.0f;
            for (int o = 8; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o, 16);
            if (t == 0 && r < j.rows) out[(size_t)(j.out_row + c) * os + j.out_col + r] = acc;
        }
        return;
    }
    float acc[MVQ_ROWS][N];
#pragma unroll
    for (int i = 0; i < MVQ_ROWS; i++)
#pragma unroll
        for (int c = 0; c < N; c++) acc[i][c] = 0.0f;
    for (int t = lane + 32 * part; t < tasks; t += 32 * split) {
#pragma unroll
        for (int i = 0; i < MVQ_ROWS; i++)
            if (r0 + i < j.rows) {
                MvqW<F> w = mvq_load<F>((const u8*)j.w + (size_t)(r0 + i) * j.row_bytes, t);
#pragma unroll
                for (int c = 0; c < N; c++)
                    if (c < n) acc[i][c] += mvq_dot<F>(w, t, xq[c], xd[c], xsum[c]);
            }
    }
#pragma unroll
    for (int i = 0; i < MVQ_ROWS; i++)
#pragma unroll
        for (int c = 0; c < N; c++) {
            float a = acc[i][c];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_down_sync(0xffffffff, a, o);
            acc[i][c] = a;
        }
    if (split > 1) {
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < MVQ_ROWS; i++)
#pragma unroll
                for (int c = 0; c < N; c++) partial[warp][i][c] = acc[i][c];
        // The warps of this pair of rows only (barrier 1 + its index; 0 is __syncthreads's).
        // (Immediate ids: a computed one makes ptxas reserve all 16.)
        if (warp / split == 0) asm volatile("bar.sync 1, %0;" ::"r"(32 * split) : "memory");
        else asm volatile("bar.sync 2, %0;" ::"r"(32 * split) : "memory");
        if (part != 0) return;
#pragma unroll
        for (int i = 0; i < MVQ_ROWS; i++)
#pragma unroll
            for (int c = 0; c < N; c++) {
                float a = partial[warp][i][c];
                for (int p = 1; p < split; p++) a += partial[warp + p][i][c];
                acc[i][c] = a;
            }
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < MVQ_ROWS; i++)
            if (r0 + i < j.rows)
#pragma unroll
                for (int c = 0; c < N; c++)
                    if (c < n) out[(size_t)(j.out_row + c) * os + j.out_col + r0 + i] = acc[i][c];
}

// Kept experts (see mv_kept) on int8 activations: the pair's input row is quantized at
// qx + (x_per_pair ? pair : token) * qstride.
template <int F>
__device__ void mvq_kept(const Kept& kp, const float* routes, const u8* qx, int qstride, float* out, int os) {
    mvq<F, 1>(kept_job(kp, routes), qx, qstride, 0, out, os);
}

// The weight rows of this block of `mvq` (one stretch: rows are stored back to back), asked of
// L2 while the kernel before runs (see prefetch_l2): a one-token step's dense products waited
// for that kernel and then fetched their rows from HBM, one round trip after another.
template <int F>
__device__ __forceinline__ void mvq_prefetch(const Jobs& js) {
    if (!js.prefetch || threadIdx.x != 0) return;
    const Job& j = js.job[blockIdx.y];
    int per = (MVQ_WARPS / mvq_split<F>(j.cols)) * MVQ_ROWS;
    int r0 = blockIdx.x * per;
    if (r0 < j.rows) prefetch_l2((const u8*)j.w + (u64)r0 * j.row_bytes, (u64)min(per, j.rows - r0) * j.row_bytes);
}

#define INT8_KERNELS(name, id)                                                                            \
    extern "C" __global__ void mvq_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out,    \
                                          int os) {                                                       \
        mvq_prefetch<id>(js);                                                                             \
        PDL_START;                                                                                        \
        mvq<id, 1>(js.job[blockIdx.y], qx, qstride, lo, out, os);                                         \
    }                                                                                                     \
    extern "C" __global__ void mvqn_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out,   \
                                           int os) {                                                      \
        mvq_prefetch<id>(js);                                                                             \
        PDL_START;                                                                                        \
        mvq<id, MV_TOKENS>(js.job[blockIdx.y], qx, qstride, lo, out, os);                                 \
    }                                                                                                     \
    extern "C" __global__ void mvkq_##name(const Kept kp, const float* routes, const u8* qx, int qstride, \
                                           float* out, int os) { PDL_START;                                          \
        mvq_kept<id>(kp, routes, qx, qstride, out, os);                                                   \
    }

INT8_KERNELS(q8_0, 8)
INT8_KERNELS(q4_k, 12)
INT8_KERNELS(q6_k, 14)

#define FORMAT_KERNELS(name, id)                                                                      \
    extern "C" __global__ void mv_##name(const Jobs js, const float* x, int xs, float* out, int os) { PDL_START;  \
        mv<id, MV_TOKENS>(js.job[blockIdx.y], x, xs, out, os);                                        \
    }                                                                                                 \
    extern "C" __global__ void mv1_##name(const Jobs js, const float* x, int xs, float* out, int os) { PDL_START; \
        mv<id, 1>(js.job[blockIdx.y], x, xs, out, os);                                                \
    }                                                                                                 \
    extern "C" __global__ void mvk_##name(const Kept kp, const float* routes, const float* x, int xs,  \
                                          float* out, int os) { PDL_START;                                       \
        mv_kept<id>(kp, routes, x, xs, out, os);                                                      \
    }                                                                                                 \
    extern "C" __global__ void mm_##name(const Jobs js, const float* x, int xs, float* out, int os) { PDL_START;  \
        mm<id>(js, x, xs, out, os);                                                                   \
    }                                                                                                 \
    extern "C" __global__ void mmt_##name(const Jobs js, const float* x, int xs, float* out, int os) { PDL_START; \
        mm_tc<id>(js, blockIdx.z, 0, 1 << 30, x, xs, out, os);                                        \
    }                                                                                                 \
    extern "C" __global__ void embed_##name(const u8* t, u64 rb, int cols, const int* ids, float* o) { PDL_START; \
        embed<id>(t, rb, cols, ids, o);                                                               \
    }                                                                                                 \
    extern "C" __global__ void mt_##name(const u8* w, u64 rb, int m, int cols, const float* x, int xs, \
                                         int n, float* out) { PDL_START;                                         \
        mt<id>(w, rb, m, cols, x, xs, n, out);                                                        \
    }

FORMAT_KERNELS(f32, 0)
FORMAT_KERNELS(f16, 1)
FORMAT_KERNELS(q4_0, 2)
FORMAT_KERNELS(q4_1, 3)
FORMAT_KERNELS(q5_0, 6)
FORMAT_KERNELS(q5_1, 7)
FORMAT_KERNELS(q8_0, 8)
FORMAT_KERNELS(q2_k, 10)
FORMAT_KERNELS(q3_k, 11)
FORMAT_KERNELS(q4_k, 12)
FORMAT_KERNELS(q5_k, 13)
FORMAT_KERNELS(q6_k, 14)
FORMAT_KERNELS(bf16, 30)
FORMAT_KERNELS(mxfp4, 39)
FORMAT_KERNELS(mxfp8, 200)
FORMAT_KERNELS(fp8, 201)

// f32 products split over their columns (the router of a prefill chunk: 128 rows by 512 tokens
// made 16 tiles of 2048 columns each, 16 blocks on 132 SMs, 0.23 ms a layer): block z takes
// slice z % slices (`slice_groups` groups of 32 columns) of job z / slices into its own plane
// of `part` (`plane` floats apart, laid out as the output), and `sum_slices` adds the planes in
// order, so the result does not depend on the schedule.
extern "C" __global__ void mmt_split_f32(const Jobs js, int slices, int slice_groups, const float* x, int xs, float* part,
                                         int plane, int os) { PDL_START;
    int s = blockIdx.z % slices, lo = s * slice_groups;
    mm_tc<0>(js, blockIdx.z / slices, lo, lo + slice_groups, x, xs, part + (size_t)s * plane, os);
}

// The planes of `mmt_split_f32` summed into each job's outputs: grid (blocks, jobs). A slice
// past a job's columns left zeros in its plane.
extern "C" __global__ void sum_slices(const Jobs js, int slices, const float* part, int plane, float* out, int os) { PDL_START;
    const Job& j = js.job[blockIdx.y];
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < j.n * j.rows; e += gridDim.x * blockDim.x) {
        int t = e / j.rows, r = e % j.rows;
        size_t i = (size_t)(j.out_row + t) * os + j.out_col + r;
        float a = 0.0f;
        for (int k = 0; k < slices; k++) a += part[(size_t)k * plane + i];
        out[i] = a;
    }
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; w++) s += part[w];
    return s;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    __syncthreads();
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float s = NEG_INF;
    for (int w = 0; w < (int)blockDim.x / 32; w++) s = fmaxf(s, part[w]);
    return s;
}

// A row's norm, out = x / rms * w (quantized for the int8 mat-vec at qx when given; dim a
// multiple of 32 then), after x += y where y is given (x is only read without it, and may be
// out: each element is read before the same thread writes it). Sums as a block of `threads`
// threads (a multiple of 32, at most 1024) would with block_sum, whatever this block's own
// size (a multiple of 32): each warp stands in for warps warp, warp + blockDim.x / 32, ... of
// that block, each lane summing its elements in order, and the warp sums are added in warp
// order. So `rms_norm` and `add_rms_norm` (threads = blockDim.x) and the last block of a
// larger kernel (threads = those kernels' norm_threads) give the same bits. x and y are read
// through L2: in a last block, other blocks wrote them, and this SM's L1 may hold what they
// were before.
__device__ void norm_row(float* x, const float* y, const float* w, float* out, int dim, float eps, u8* qx,
                         int threads) {
    __shared__ float part[32];
    int lane = threadIdx.x % 32;
    for (int vw = threadIdx.x / 32; vw < threads / 32; vw += blockDim.x / 32) {
        float s = 0.0f;
        for (int i = 32 * vw + lane; i < dim; i += threads) {
            float v = __ldcg(x + i);
            if (y) {
                v += __ldcg(y + i);
                x[i] = v;
            }
            s += v * v;
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) part[vw] = s;
    }
    __syncthreads();  // part, and x's new values, seen by the whole block
    float s = 0.0f;
    for (int v = 0; v < threads / 32; v++) s += part[v];
    float scale = rsqrtf(s / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = w[i] * (__ldcg(x + i) * scale);
        out[i] = v;
        if (qx) quantize_group(v, qx, dim, i / 32);
    }
}

// out[t * os + oo + i] = x[t * xs + xo + i] / rms * w[i]: one block per row (norm_row; in
// place when out == x). With qx, each output row is also quantized for the int8 mat-vec at
// qx + t * qstride.
extern "C" __global__ void rms_norm(const float* x, int xs, int xo, const float* w, float* out, int os, int oo,
                                    int dim, float eps, u8* qx, int qstride) { PDL_START;
    size_t t = blockIdx.x;
    // (Only read: norm_row writes x only when given a y.)
    float* row = (float*)x + t * xs + xo;
    norm_row(row, nullptr, w, out + t * os + oo, dim, eps, qx ? qx + t * qstride : nullptr, blockDim.x);
}

// In place over `heads` vectors of `dim` end to end from xo in each row (at xs): block r is
// head r % heads of row r / heads.
extern "C" __global__ void rms_norm_heads(float* x, int xs, int xo, int heads, const float* w, int dim, float eps) { PDL_START;
    float* row = x + (size_t)(blockIdx.x / heads) * xs + xo + (size_t)(blockIdx.x % heads) * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += row[i] * row[i];
    float scale = rsqrtf(block_sum(s) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) row[i] = w[i] * (row[i] * scale);
}

extern "C" __global__ void add(float* x, const float* y, int len) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += y[i];
}

extern "C" __global__ void silu_mul(float* g, const float* u, int len) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) {
        float a = g[i];
        g[i] = a / (1.0f + expf(-a)) * u[i];
    }
}

// Rows row0.. of stride: x[0..w] = silu(x[0..w]) * x[w..2w].
extern "C" __global__ void silu_mul_halves(float* x, int row0, int n, int stride, int w) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * w) return;
    float* row = x + (size_t)(row0 + i / w) * stride;
    int c = i % w;
    float a = row[c];
    row[c] = a / (1.0f + expf(-a)) * row[w + c];
}

// gpt-oss's clamped SwiGLU (Backend::swiglu_clamped_halves).
extern "C" __global__ void swiglu_clamped_halves(float* x, int row0, int n, int stride, int w, float alpha, float limit) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * w) return;
    float* row = x + (size_t)(row0 + i / w) * stride;
    int c = i % w;
    float g = fminf(row[c], limit);
    float u = fminf(fmaxf(row[w + c], -limit), limit);
    row[c] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
}

extern "C" __global__ void add_bias(float* x, int n, int stride, int off, const float* b, int len) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * len) x[(size_t)(i / len) * stride + off + i % len] += b[i % len];
}

extern "C" __global__ void scale_rows(float* x, int dim, const float* s, int n) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * dim) x[i] *= s[i / dim];
}

extern "C" __global__ void copy_strided(const float* src, int ss, int so, float* dst, int ds, int dof, int width,
                                        int n) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * width) dst[(size_t)(i / width) * ds + dof + i % width] = src[(size_t)(i / width) * ss + so + i % width];
}

// dst[i] = src[rows[i]] (gather) or dst[rows[i]] = src[i] (scatter), rows of dim.
extern "C" __global__ void move_rows(const float* src, float* dst, int dim, const int* rows, int count, int scatter) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count * dim) return;
    int k = i / dim, c = i % dim;
    if (scatter) dst[(size_t)rows[k] * dim + c] = src[(size_t)k * dim + c];
    else dst[(size_t)k * dim + c] = src[(size_t)rows[k] * dim + c];
}

// As `move_rows`, 16 bytes a thread (rows of dim4 such units, 16-byte aligned), a block row per
// moved row (grid y, striding past 65,535): no division per element. The per-float kernel took
// 49 µs per gather or scatter of a MoE layer's 4,096 rows of 2,048 floats. Bits are copied as
// they are, so it also moves the int8 copies of gathered rows.
extern "C" __global__ void move_rows4(const uint4* src, uint4* dst, int dim4, const int* rows, int count, int scatter) { PDL_START;
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim4) return;
    for (int k = blockIdx.y; k < count; k += gridDim.y) {
        if (scatter) dst[(size_t)rows[k] * dim4 + c] = src[(size_t)k * dim4 + c];
        else dst[(size_t)k * dim4 + c] = src[(size_t)rows[k] * dim4 + c];
    }
}

// out[t] += sum_s weights[t ws + wo + s] src[t k + s] in slot order.
extern "C" __global__ void add_weighted_slots(const float* src, int dim, int n, int k, const float* weights, int ws,
                                              int wo, float* out) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * dim) return;
    int t = i / dim, c = i % dim;
    float a = out[i];
    for (int s = 0; s < k; s++) a += weights[t * ws + wo + s] * src[(size_t)(t * k + s) * dim + c];
    out[i] = a;
}

// exp as the host's libm gives it (correctly rounded in all but rare cases): in double, rounded
// once, so that routes chosen here match the host's bit for bit as far as possible.
__device__ __forceinline__ float exp_rounded(float x) { return (float)exp((double)x); }

// A float's order as an unsigned key (larger value, larger key; -0 as +0), 0 for what is never
// chosen: -inf (taken or masked) and NaN.
__device__ __forceinline__ u32 order_key(float v) {
    if (!(v > NEG_INF)) return 0;
    u32 b = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Warp-wide maximum: one instruction from compute 8.0, shuffles before.
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffff, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
#endif
}

// Routing on the device, one warp per token, as RouterRule::route does on the host: softmax
// (sigmoid = 0), or sigmoid (1) or sqrt-softplus (2, DeepSeek-V4) scores plus correction bias restricted to the best `topk_group` of
// `n_group` groups (a group scores the sum of its two best); top-k, weights renormalised
// (norm) and scaled. Sums run in the host's order. Out: routes[t][0..k] ids as floats,
// [k..2k] weights. Dynamic shared memory: 2 e + 2 k floats. Token t's, by one warp (lane: its
// lane); the logits are read through L2 (`__ldcg`): in mvs_f32_route other blocks of the same
// launch wrote them.
__device__ void route_token(const float* logits, int e, const float* bias, int sigmoid, int n_group, int topk_group,
                            int k, int norm, float scaling, float* routes, int t, int lane) {
    extern __shared__ float sh[];
    float* choice = sh;
    float* wsrc = sh + e;
    const float* l = logits + (size_t)t * e;
    float* out = routes + (size_t)t * 2 * k;
    if (!sigmoid) {
        float m = NEG_INF;
        for (int i = lane; i < e; i += 32) m = fmaxf(m, __ldcg(l + i));
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
        for (int i = lane; i < e; i += 32) choice[i] = exp_rounded(__ldcg(l + i) - m);
        __syncwarp();
        // In the host's order, one add after another; four values a shared-memory load (one
        // load per value kept this serial chain waiting on each load).
        float sum = 0.0f;
        if (lane == 0) {
            int i = 0;
            if ((e & 3) == 0 && ((size_t)choice & 15) == 0) {
#pragma unroll 8
                for (; i < e; i += 4) {
                    float4 c = *(const float4*)(choice + i);
                    sum += c.x;
                    sum += c.y;
                    sum += c.z;
                    sum += c.w;
                }
            }
            for (; i < e; i++) sum += choice[i];
        }
        sum = __shfl_sync(0xffffffff, sum, 0);
        for (int i = lane; i < e; i += 32) wsrc[i] = choice[i] = choice[i] / sum;
    } else {
        for (int i = lane; i < e; i += 32) {
            // 1: sigmoid; 2: sqrt(softplus), softplus linear above 20 as torch has it.
            float li = __ldcg(l + i);
            float score = sigmoid == 1 ? 1.0f / (1.0f + exp_rounded(-li))
                                       : sqrtf(li > 20.0f ? li : (float)log1p((double)exp_rounded(li)));
            wsrc[i] = score;
            choice[i] = score + (bias ? bias[i] : 0.0f);
        }
        __syncwarp();
        // Lane g scores group g (n_group <= 32, checked on the host), then lane 0 keeps the best.
        int per = e / n_group;
        float gs = NEG_INF;
        if (lane < n_group) {
            const float* grp = choice + lane * per;
            int b0 = 0;
            for (int i = 1; i < per; i++)
                if (grp[i] > grp[b0]) b0 = i;
            gs = grp[b0];
            if (per >= 2) {
                int b1 = b0 == 0 ? 1 : 0;
                for (int i = 0; i < per; i++)
                    if (i != b0 && grp[i] > grp[b1]) b1 = i;
                gs = gs + grp[b1];
            }
        }
        unsigned keep = 0;
        for (int r = 0; r < topk_group; r++) {
            float v = lane < n_group && !(keep >> lane & 1) ? gs : NEG_INF;
            int bi = lane < n_group && !(keep >> lane & 1) ? lane : 32;
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffff, v, o);
                int oi = __shfl_xor_sync(0xffffffff, bi, o);
                if (ov > v || (ov == v && oi < bi)) v = ov, bi = oi;
            }
            if (bi < 32) keep |= 1u << bi;
        }
        __syncwarp();
        for (int i = lane; i < e; i += 32)
            if (!(keep >> (i / per) & 1)) choice[i] = 0.0f;
    }
    __syncwarp();
    // Top k: each round the warp's largest candidate (ties to the lower index) by two
    // reductions of order-preserving keys, the pick kept in shared memory; the output written
    // once at the end, in parallel (lane 0 writing each pick to global memory and reading the
    // weights back to normalise them was most of this kernel's 9 µs).
    float* pick_w = sh + 2 * e;
    float* pick_id = pick_w + k;
    for (int r = 0; r < k; r++) {
        u32 best = 0;
        int bi = e;
        for (int i = lane; i < e; i += 32) {
            u32 key = order_key(choice[i]);
            if (key > best) best = key, bi = i;
        }
        u32 top = warp_max_u32(best);
        // The lowest index among the lanes holding it: a minimum, as the maximum of complements.
        int id = (int)~warp_max_u32(top != 0 && best == top ? ~(u32)bi : 0u);
        if (top == 0) id = 0;  // nothing compares (all NaN): expert 0, never outside
        __syncwarp();
        if (lane == 0) {
            pick_id[r] = (float)id;
            pick_w[r] = wsrc[id];
            choice[id] = NEG_INF;
        }
        __syncwarp();
    }
    float sum = 0.0f;
    if (norm) {
        for (int r = 0; r < k; r++) sum += pick_w[r];
        sum += sigmoid ? 1e-20f : 0.0f;
    }
    for (int r = lane; r < k; r += 32) {
        float w = pick_w[r];
        if (norm) w /= sum;
        if (scaling != 1.0f) w *= scaling;
        out[r] = pick_id[r];
        out[k + r] = w;
    }
}

extern "C" __global__ void route(const float* logits, int e, const float* bias, int sigmoid, int n_group,
                                 int topk_group, int k, int norm, float scaling, float* routes) { PDL_START;
    route_token(logits, e, bias, sigmoid, n_group, topk_group, k, norm, scaling, routes, blockIdx.x, threadIdx.x);
}

// One thread per (token, head, pair): cs holds n * half cosines then n * half sines.
extern "C" __global__ void rope(float* x, int n, int stride, int off, int heads, int head_stride, const float* cs,
                                int half, int interleaved) { PDL_START;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * heads * half) return;
    int t = i / (heads * half), h = (i / half) % heads, p = i % half;
    float* base = x + (size_t)t * stride + off + (size_t)h * head_stride;
    float c = cs[t * half + p], s = cs[n * half + t * half + p];
    int ia = interleaved ? 2 * p : p, ib = interleaved ? 2 * p + 1 : p + half;
    float a = base[ia], b = base[ib];
    base[ia] = a * c - b * s;
    base[ib] = b * c + a * s;
}

// The splits of one (token, query head) row of `attention` merged (row blockIdx.x): their
// maxima, sums and outputs rescaled to the largest maximum and summed in split order, the
// output written (and, with qx, quantized) as an unsplit row is. Some split holds a position
// the row sees, so the largest maximum is finite (a split wholly outside the row's window
// left minus infinity). `sink`: the head's sink logit, which joins the sum and the maximum
// (minus infinity: none). Read through L2 (`__ldcg`): other blocks wrote them.
__device__ void merge_splits(const float* pp, int splits, int vd, int q_heads, int t, int h, float* out, u8* qx,
                             int qstride, float sink) {
    float m = sink;
    for (int s = 0; s < splits; s++) m = fmaxf(m, __ldcg(pp + (size_t)s * (vd + 2)));
    float l = expf(sink - m);
    for (int s = 0; s < splits; s++) l += __ldcg(pp + (size_t)s * (vd + 2) + 1) * expf(__ldcg(pp + (size_t)s * (vd + 2)) - m);
    float inv = 1.0f / l;
    for (int d = threadIdx.x; d < vd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) a += __ldcg(pp + (size_t)s * (vd + 2) + 2 + d) * expf(__ldcg(pp + (size_t)s * (vd + 2)) - m);
        float o = a * inv;
        out[((size_t)t * q_heads + h) * vd + d] = o;
        if (qx) quantize_group(o, qx + (size_t)t * qstride, q_heads * vd, (h * vd + d) / 32);
    }
}

// One (query, head) of `attention`, a block's: the query in row t of q and of out, at position
// pos; with part (this row's splits' partial results, `splits` of them) only split si's
// positions, the last split to finish merging (ticket: the row's counter).
__device__ __forceinline__ void attention_one(const float* k, const float* v, int heads, int kd, int vd, int v_row,
                                              int v_head, const float* q, int q_stride, int q_heads, int t, int h,
                                              int pos, float scale, float* out, u8* qx, int qstride, int split,
                                              int si, int splits, float* part, int* ticket, int first, int window,
                                              const float* sinks) {
    extern __shared__ float sh[];
    float* qs = sh;
    float* sc = sh + kd;
    float* acc = sc + blockDim.x;
    int g = h / (q_heads / heads);
    int len = pos + 1, k_row = heads * kd;
    float sink = sinks ? sinks[h] : NEG_INF;
    // With part: only positions lo..len of split si (see merge_splits).
    int lo = part ? first + si * split : 0;
    if (part) len = min(len, lo + split);
    if (window > 0) lo = max(lo, pos + 1 - window);
    for (int i = threadIdx.x; i < kd; i += blockDim.x) qs[i] = q[(size_t)t * q_stride + h * kd + i];
    for (int i = threadIdx.x; i < vd; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();
    float m = NEG_INF, l = 0.0f;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int start = lo; start < len; start += blockDim.x) {
        int j = start + threadIdx.x;
        // The chunk's scores, a warp per position: its lanes read the key row together (a
        // thread per position read its own row alone, kd loads one after another).
        int cnt = min((int)blockDim.x, len - start);
        for (int jj = warp; jj < cnt; jj += warps) {
            const float* kr = k + (size_t)(start + jj) * k_row + g * kd;
            float d = 0.0f;
            for (int i = lane; i < kd; i += 32) d += qs[i] * kr[i];
            for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffff, d, o);
            if (lane == 0) sc[jj] = d * scale;
        }
        __syncthreads();
        float s = j < len ? sc[threadIdx.x] : NEG_INF;
        float m_new = fmaxf(m, block_max(s));
        float p = j < len ? expf(s - m_new) : 0.0f;
        sc[threadIdx.x] = p;
        float alpha = expf(m - m_new);
        l = l * alpha + block_sum(p);
        m = m_new;
        __syncthreads();
        for (int d = threadIdx.x; d < vd; d += blockDim.x) {
            float a = acc[d] * alpha;
            const float* vc = v + (size_t)start * v_row + g * v_head + d;
            for (int jj = 0; jj < cnt; jj++) a += sc[jj] * vc[(size_t)jj * v_row];
            acc[d] = a;
        }
        __syncthreads();
    }
    if (part) {  // this split's maximum, sum and unnormalised output
        float* pp = part + (size_t)si * (vd + 2);
        if (threadIdx.x == 0) pp[0] = m, pp[1] = l;
        for (int d = threadIdx.x; d < vd; d += blockDim.x) pp[2 + d] = acc[d];
        // The row's last split to finish merges them all, in this launch (a merging kernel
        // after was one more launch a layer): its ticket says it is last, the fences make the
        // other splits' writes visible to it, and it leaves the ticket at 0 for the next launch.
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == splits - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        merge_splits(part, splits, vd, q_heads, t, h, out, qx, qstride, sink);
        if (threadIdx.x == 0) *ticket = 0;
        return;
    }
    // Unsplit, the row saw a position (m finite); the sink joins the sum at the larger maximum.
    float mm = fmaxf(m, sink), rescale = expf(m - mm);
    float inv = rescale / (l * rescale + expf(sink - mm));
    for (int d = threadIdx.x; d < vd; d += blockDim.x) {
        float o = acc[d] * inv;
        out[((size_t)t * q_heads + h) * vd + d] = o;
        // With qx (vd a multiple of 32): the row quantized for the output projection's int8
        // mat-vec, a warp's 32 values one group.
        if (qx) quantize_group(o, qx + (size_t)t * qstride, q_heads * vd, (h * vd + d) / 32);
    }
}

// Causal attention, one block per (token, query head), online softmax over chunks of
// blockDim.x positions (a multiple of 32). With `part`, the positions from `first` on are
// split in runs of `split` over blockIdx.y (flash-decoding: a long context's few queries
// still fill the GPU), each block leaving its partial softmax in `part`, the last one merging
// them (merge_splits). Keys: [pos][heads * kd]; values: [pos][v_row] with head g at g * v_head
// (values_in_keys: the keys themselves, v_head = kd). `window` > 0: the query at position p
// sees p + 1 - window..=p only; `first` is then the first position the first query sees.
// `sinks` (or null): a logit per query head that joins the softmax's sum and contributes no
// value (gpt-oss). Dynamic shared memory: kd + blockDim.x + vd floats.
extern "C" __global__ void attention(const float* k, const float* v, int heads, int kd, int vd, int v_row,
                                     int v_head, const float* q, int q_stride, int q_heads, int pos0, float scale,
                                     float* out, u8* qx, int qstride, int split, float* part, int* tickets, int first,
                                     int window, const float* sinks, int prefetch) {
    int t = blockIdx.x / q_heads, h = blockIdx.x % q_heads;
    if (prefetch && h == 0 && threadIdx.x == 0) {
        // The keys and values of the positions this split reads, all heads' (asked once, by
        // head 0's block), asked of L2 while the kernel before runs (see prefetch_l2): mostly
        // cache rows of earlier steps, which attention otherwise fetched after its wait, a warp
        // per position. The range includes the rows of this step's tokens, which the kernel
        // before is writing: those requests are wasted, and the rows are read after the wait.
        int pos = pos0 + t, lo = part ? first + (int)blockIdx.y * split : 0, len = pos + 1;
        if (part) len = min(len, lo + split);
        if (window > 0) lo = max(lo, pos + 1 - window);
        if (len > lo) {
            prefetch_l2(k + (size_t)lo * heads * kd, (u64)(len - lo) * heads * kd * 4);
            if (v != k) prefetch_l2(v + (size_t)lo * v_row, (u64)(len - lo) * v_row * 4);
        }
    }
    PDL_START;
    float* pp = part ? part + (size_t)blockIdx.x * gridDim.y * (vd + 2) : nullptr;
    attention_one(k, v, heads, kd, vd, v_row, v_head, q, q_stride, q_heads, t, h, pos0 + t, scale, out, qx, qstride,
                  split, blockIdx.y, gridDim.y, pp, tickets + blockIdx.x, first, window, sinks);
}

// `attention` of the sequences of a step at once, each over its own keys and values and with
// its own splits (`SeqKv`): blocks (row of the step from t0 and head, split); a row's splits
// past its sequence's leave at once. part: max_splits partial results a row. One launch takes
// the rows from t0 that its table's sequences (at most MAX_SEQS) hold.
extern "C" __global__ void attention_seqs(int heads, int kd, int vd, int v_row, int v_head, const float* q,
                                          int q_stride, int q_heads, float scale, float* out, u8* qx, int qstride,
                                          float* part, int* tickets, int window, const float* sinks, int t0,
                                          const SeqKvs ss) { PDL_START;
    int t = t0 + blockIdx.x / q_heads, h = blockIdx.x % q_heads;
    const SeqKv& s = ss.s[seq_of(ss, t)];
    if ((int)blockIdx.y >= s.splits) return;  // the whole block, before any barrier
    float* pp = s.splits > 1 ? part + (size_t)blockIdx.x * ss.max_splits * (vd + 2) : nullptr;
    attention_one((const float*)s.k, (const float*)s.v, heads, kd, vd, v_row, v_head, q, q_stride, q_heads, t, h,
                  s.pos0 + t - s.row, scale, out, qx, qstride, s.split, blockIdx.y, s.splits, pp, tickets + blockIdx.x,
                  s.first, window, sinks);
}

// Decode mat-vec over Q8_0 rows, tuned (half a warp per 34-byte block, 16-bit loads): the
// bandwidth probe of `Gpu::matvec_q8_0`.
extern "C" __global__ void matvec_q8_0(const unsigned char* w, const float* x, float* out, int rows, int cols) { PDL_START;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int blocks = cols / 32;
    const unsigned char* r = w + (size_t)row * blocks * 34;
    int half = lane / 16, pair = lane % 16;
    float acc = 0.0f;
    for (int b0 = 0; b0 < blocks; b0 += 16) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int b = b0 + 2 * k + half;
            if (b < blocks) {
                const unsigned short* p = (const unsigned short*)(r + (size_t)b * 34);
                float d;
                asm("cvt.f32.f16 %0, %1;" : "=f"(d) : "h"(p[0]));
                unsigned short two = p[1 + pair];
                float2 xv = *(const float2*)(x + b * 32 + 2 * pair);
                acc += d * ((float)(signed char)(two & 0xff) * xv.x + (float)(signed char)(two >> 8) * xv.y);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffff, acc, o);
    if (lane == 0) out[row] = acc;
}
