// Prefill attention, appended to kernels.cu (whose helpers it uses).

#define AT_Q 32
#define AT_K 16
#define AT_D 128

// Causal attention of many queries, flash-style: a block takes AT_Q consecutive queries of one
// head through the keys in tiles of AT_K, each tile staged in shared memory once for all of
// them (the one-block-per-query kernel read every key once per query: 1.2 ms a layer for 512
// tokens of a 30B-shape model), with an online softmax per query. kd, vd <= AT_D. 256 threads,
// 8 per query: each scores two keys of a tile and owns every eighth of the query's output
// values. Grid (query tiles, query heads). Layout as `attention`.
extern "C" __global__ void attention_tiles(const float* k, const float* v, int heads, int kd, int vd, int v_row,
                                           int v_head, const float* q, int q_stride, int q_heads, int n, int pos0,
                                           float scale, float* out) { PDL_START;
    __shared__ float qs[AT_Q][AT_D + 1];
    __shared__ float ks[AT_K][AT_D + 1];
    __shared__ float vs[AT_K][AT_D + 1];
    __shared__ float ps[AT_Q][AT_K + 1];
    int h = blockIdx.y, t0 = blockIdx.x * AT_Q;
    int g = h / (q_heads / heads), k_row = heads * kd;
    int tid = threadIdx.x, qi = tid / 8, sub = tid % 8;
    for (int e = tid; e < AT_Q * kd; e += blockDim.x) {
        int r = e / kd, c = e % kd;
        qs[r][c] = t0 + r < n ? q[(size_t)(t0 + r) * q_stride + h * kd + c] : 0.0f;
    }
    float o[AT_D / 8];
#pragma unroll
    for (int j = 0; j < AT_D / 8; j++) o[j] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    // Row qi sees keys 0..lim; the block's last row that exists, keys 0..last.
    int t = t0 + qi, lim = pos0 + t, last = pos0 + min(t0 + AT_Q, n) - 1;
    for (int k0 = 0; k0 <= last; k0 += AT_K) {
        __syncthreads();  // the previous tile is used up (and, the first time, qs written)
        for (int e = tid; e < AT_K * kd; e += blockDim.x) {
            int r = e / kd, c = e % kd;
            ks[r][c] = k0 + r <= last ? k[(size_t)(k0 + r) * k_row + g * kd + c] : 0.0f;
        }
        for (int e = tid; e < AT_K * vd; e += blockDim.x) {
            int r = e / vd, c = e % vd;
            vs[r][c] = k0 + r <= last ? v[(size_t)(k0 + r) * v_row + g * v_head + c] : 0.0f;
        }
        __syncthreads();
        float s0 = 0.0f, s1 = 0.0f;
        for (int i = 0; i < kd; i++) {
            float a = qs[qi][i];
            s0 += a * ks[sub][i];
            s1 += a * ks[sub + 8][i];
        }
        int j0 = k0 + sub, j1 = j0 + 8;
        s0 = j0 <= lim ? s0 * scale : NEG_INF;
        s1 = j1 <= lim ? s1 * scale : NEG_INF;
        // The row's 8 threads are 8 consecutive lanes of one warp.
        float mx = fmaxf(s0, s1);
        for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
        float m_new = fmaxf(m, mx);  // finite: key 0 is in every row's first tile
        float p0 = j0 <= lim ? expf(s0 - m_new) : 0.0f, p1 = j1 <= lim ? expf(s1 - m_new) : 0.0f;
        float sum = p0 + p1;
        for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
        float alpha = expf(m - m_new);
        l = l * alpha + sum;
        m = m_new;
        ps[qi][sub] = p0;
        ps[qi][sub + 8] = p1;
        __syncwarp();
#pragma unroll
        for (int j = 0; j < AT_D / 8; j++) {
            int d = sub + 8 * j;
            if (d < vd) {
                float a = o[j] * alpha;
#pragma unroll
                for (int kk = 0; kk < AT_K; kk++) a += ps[qi][kk] * vs[kk][d];
                o[j] = a;
            }
        }
    }
    if (t >= n) return;
    float inv = 1.0f / l;
#pragma unroll
    for (int j = 0; j < AT_D / 8; j++) {
        int d = sub + 8 * j;
        if (d < vd) out[((size_t)t * q_heads + h) * vd + d] = o[j] * inv;
    }
}

// The same attention on tensor cores (compute 8.0 and later), for head sizes that are multiples
// of 8 up to AT_D. The f32 kernel above took 25 ms of a 111 ms 512-token prefill of the 30B
// shape (0.52 ms a layer): every score and every weighted value was an f32 multiply-add on the
// CUDA cores. Here both products are m16n8k8 TF32 MMAs, each operand split into a TF32 value and
// its TF32 remainder and three products summed (big·big + big·small + small·big, as `mm_tc`
// does), which keeps f32 accuracy: prefill must stay within 1e-4 of step decode.
//
// A block takes AM_Q consecutive queries of one head (four warps of 16) through the keys in
// tiles of AM_K staged in shared memory. Each warp keeps its queries as A fragments in
// registers, scores a tile (16 × AM_K), runs the online softmax on the fragments (a row's
// values lie in the four lanes of one group), writes the probabilities to its own shared rows
// to reload them as A fragments, and adds P · V into its output fragments. 128 threads.
// Layout as `attention`.
//
// A query tile's keys are split in runs of `chunk` (a multiple of AM_K) over blocks, as
// flash-decoding splits a decoded row's: unsplit, a 512-token prefill took 243 µs a layer,
// bound by the chain of dependent instructions of its last tile's warps (16 key tiles one
// after another, two warps per scheduler) while the GPU could issue the whole layer's work in
// about 20 µs. Grid (work items, query heads): item 0 is the last query tile's first run (the
// heaviest tiles start first), then its other runs, then the tile before. A tile of one run
// writes its output; one of several leaves each run's maxima, sums and unnormalised outputs in
// `part` ([AM_Q rows][vd + 2] a run, the runs of a head's tiles one after another in item
// order), and the run that finishes last merges them (a ticket per tile, left at 0).
#define AM_Q 64
#define AM_K 32
// Row strides in floats, chosen so that a warp's fragment loads fall in 32 different banks:
// keys 4 mod 32 (8 keys × 4 dims), values 8 mod 32 (4 keys × 8 dims), probabilities 4 mod 32.
#define AM_KS (AT_D + 4)
#define AM_VS (AT_D + 8)
#define AM_PS (AM_K + 4)

#if __CUDA_ARCH__ >= 800
// An A fragment (four f32 values) split into TF32 big and small parts.
__device__ __forceinline__ void split_a(const float* a, u32* big, u32* small) {
#pragma unroll
    for (int i = 0; i < 4; i++) split_tf32(a[i], &big[i], &small[i]);
}

// c += a · b to f32 accuracy (3xTF32), a already split, b two f32 values.
__device__ __forceinline__ void mma3(float* c, const u32* ab, const u32* as, float b0, float b1) {
    u32 bb[2], bs[2];
    split_tf32(b0, &bb[0], &bs[0]);
    split_tf32(b1, &bb[1], &bs[1]);
    mma_tf32(c, as, bb);
    mma_tf32(c, ab, bs);
    mma_tf32(c, ab, bb);
}
#endif

//
// D: the head size when known at compile time (128, both keys and values), else 0 (kd, vd at
// run time, up to AT_D): with it the k-steps need no test for the head's end, and their loads
// can be issued ahead of the products.
template <int D>
__device__ __forceinline__ void attention_mma_body(const float* k, const float* v, int heads, int kd, int vd, int v_row,
                                                   int v_head, const float* q, int q_stride, int q_heads, int n, int pos0,
                                                   float scale, float* out, int chunk, float* part, int* tickets) {
#if __CUDA_ARCH__ >= 800
    if (D) kd = vd = D;
    __shared__ __align__(16) float ks[AM_K * AM_KS];
    __shared__ __align__(16) float vs[AM_K * AM_VS];
    __shared__ float ps[4][16 * AM_PS];
    // This item's query tile qt and run c; `before`: the head's runs ahead of it.
    int tiles = (n + AM_Q - 1) / AM_Q, qt = tiles - 1, item = blockIdx.x, before = 0, runs = 0;
    for (;; qt--) {
        runs = (pos0 + min((qt + 1) * AM_Q, n) - 1) / chunk + 1;
        if (item < runs || qt == 0) break;
        item -= runs;
        before += runs;
    }
    if (item >= runs) return;  // past the head's last item (the grid is the largest head's count)
    int h = blockIdx.y, t0 = qt * AM_Q, c = item;
    int g = h / (q_heads / heads), k_row = heads * kd;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    // This lane's two query rows (fragment rows gid and gid + 8) and the last key each sees.
    int ra = t0 + 16 * warp + gid, rb = ra + 8;
    int lim[2] = {pos0 + ra, pos0 + rb};
    // The warp's last key: past it a tile has nothing for the warp (causal).
    int warp_last = pos0 + min(t0 + 16 * warp + 15, n - 1);
    int last = pos0 + min(t0 + AM_Q, n) - 1;
    // Queries as A fragments, a k-step of 8 dims each: (gid, tig), (gid + 8, tig), (gid, tig + 4),
    // (gid + 8, tig + 4), read from global memory (L1) at every tile: held in registers for the
    // whole head they took 64 of them, and the kernel spilled. Rows past the last query read
    // the last one (finite scores; their outputs are not stored).
    const float* qra = q + (size_t)min(ra, n - 1) * q_stride + h * kd + tig;
    const float* qrb = q + (size_t)min(rb, n - 1) * q_stride + h * kd + tig;
    float o[AT_D / 8][4];
#pragma unroll
    for (int j = 0; j < AT_D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float* pw = ps[warp];
    int k_end = min(last, (c + 1) * chunk - 1);
    for (int k0 = c * chunk; k0 <= k_end; k0 += AM_K) {
        __syncthreads();  // the previous tile is used up
        // A warp per key row, four floats a lane, copied asynchronously: with loads, each of a
        // lane's sixteen rows waited out its own trip to memory.
        for (int r = warp; r < AM_K; r += 4) {
            bool live = k0 + r <= k_end;
            const float* kr = k + (size_t)(live ? k0 + r : 0) * k_row + g * kd;
            const float* vr = v + (size_t)(live ? k0 + r : 0) * v_row + g * v_head;
            for (int c = lane; c < kd / 4; c += 32) copy16_async(ks + r * AM_KS + 4 * c, kr + 4 * c, live);
            for (int c = lane; c < vd / 4; c += 32) copy16_async(vs + r * AM_VS + 4 * c, vr + 4 * c, live);
        }
        copies_wait();
        __syncthreads();
        if (k0 > warp_last) continue;  // every key of the tile is in the warp's future
        // Scores: s[nt] holds (row gid, keys k0 + 8 nt + 2 tig, + 1) and (row gid + 8, the same).
        float s[AM_K / 8][4];
#pragma unroll
        for (int nt = 0; nt < AM_K / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int st = 0; st < AT_D / 8; st++) {
            if (8 * st >= kd) break;
            float qf[4] = {__ldg(qra + 8 * st), __ldg(qrb + 8 * st), __ldg(qra + 8 * st + 4), __ldg(qrb + 8 * st + 4)};
            u32 ab[4], as[4];
            split_a(qf, ab, as);
#pragma unroll
            for (int nt = 0; nt < AM_K / 8; nt++) {
                const float* kr = ks + (8 * nt + gid) * AM_KS + 8 * st + tig;
                mma3(s[nt], ab, as, kr[0], kr[4]);
            }
        }
        // Online softmax over the tile, per row (the row's values lie in lanes 4 gid .. 4 gid + 3).
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < AM_K / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + 8 * nt + 2 * tig + (e & 1), r = e >> 1;
                s[nt][e] = key <= lim[r] ? s[nt][e] * scale : NEG_INF;
                mx[r] = fmaxf(mx[r], s[nt][e]);
            }
        float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
            // Minus infinity only while none of the row's keys has been seen (a run that
            // starts past some of the warp's rows): then its output and sum are zeros.
            float m_new = fmaxf(m[r], mx[r]);
            alpha[r] = m_new == NEG_INF ? 1.0f : expf(m[r] - m_new);
            m[r] = m_new;
        }
#pragma unroll
        for (int nt = 0; nt < AM_K / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = k0 + 8 * nt + 2 * tig + (e & 1), r = e >> 1;
                float p = key <= lim[r] ? expf(s[nt][e] - m[r]) : 0.0f;
                sum[r] += p;
                pw[(8 * r + gid) * AM_PS + 8 * nt + 2 * tig + (e & 1)] = p;
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffff, sum[r], 2);
            l[r] = l[r] * alpha[r] + sum[r];
        }
#pragma unroll
        for (int j = 0; j < AT_D / 8; j++) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }
        __syncwarp();
        // O += P · V, k-steps of 8 keys.
#pragma unroll
        for (int st = 0; st < AM_K / 8; st++) {
            float a[4] = {pw[gid * AM_PS + 8 * st + tig], pw[(gid + 8) * AM_PS + 8 * st + tig],
                          pw[gid * AM_PS + 8 * st + tig + 4], pw[(gid + 8) * AM_PS + 8 * st + tig + 4]};
            u32 ab[4], as[4];
            split_a(a, ab, as);
#pragma unroll
            for (int nt = 0; nt < AT_D / 8; nt++) {
                if (8 * nt >= vd) break;
                const float* vr = vs + (8 * st + tig) * AM_VS + 8 * nt + gid;
                mma3(o[nt], ab, as, vr[0], vr[4 * AM_VS]);
            }
        }
        __syncwarp();  // the probabilities are read before the next tile rewrites them
    }
    if (runs > 1) {
        // This run's rows: maximum, sum, then the unnormalised outputs.
        float* pp = part + ((size_t)h * gridDim.x + before + c) * AM_Q * (vd + 2);
        float* pa = pp + (16 * warp + gid) * (vd + 2);
        float* pb = pa + 8 * (vd + 2);
        if (tig == 0) pa[0] = m[0], pa[1] = l[0], pb[0] = m[1], pb[1] = l[1];
#pragma unroll
        for (int nt = 0; nt < AT_D / 8; nt++) {
            if (8 * nt >= vd) break;
            int d = 2 + 8 * nt + 2 * tig;
            pa[d] = o[nt][0], pa[d + 1] = o[nt][1], pb[d] = o[nt][2], pb[d + 1] = o[nt][3];
        }
        __shared__ int is_last;
        __shared__ float row_max[AM_Q], row_inv[AM_Q];
        __threadfence();
        __syncthreads();
        int* ticket = tickets + (size_t)h * tiles + qt;
        if (tid == 0) is_last = atomicAdd(ticket, 1) == runs - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        // The tile's runs merged: every row's largest maximum (finite: run 0 holds key 0)
        // and total, then each output rescaled and summed in run order.
        const float* p0 = part + ((size_t)h * gridDim.x + before) * AM_Q * (vd + 2);
        size_t run_len = (size_t)AM_Q * (vd + 2);
        if (tid < AM_Q) {
            float mm = NEG_INF, ll = 0.0f;
            for (int i = 0; i < runs; i++) mm = fmaxf(mm, __ldcg(p0 + i * run_len + tid * (vd + 2)));
            for (int i = 0; i < runs; i++) {
                const float* pr = p0 + i * run_len + tid * (vd + 2);
                ll += __ldcg(pr + 1) * expf(__ldcg(pr) - mm);
            }
            row_max[tid] = mm;
            row_inv[tid] = 1.0f / ll;
        }
        __syncthreads();
        for (int e = tid; e < AM_Q * vd; e += blockDim.x) {
            int r = e / vd, d = e % vd;
            if (t0 + r >= n) break;
            float a = 0.0f;
            for (int i = 0; i < runs; i++) {
                const float* pr = p0 + i * run_len + r * (vd + 2);
                a += __ldcg(pr + 2 + d) * expf(__ldcg(pr) - row_max[r]);
            }
            out[((size_t)(t0 + r) * q_heads + h) * vd + d] = a * row_inv[r];
        }
        if (tid == 0) *ticket = 0;
        return;
    }
    float inv[2] = {1.0f / l[0], 1.0f / l[1]};
#pragma unroll
    for (int nt = 0; nt < AT_D / 8; nt++) {
        if (8 * nt >= vd) break;
        int d = 8 * nt + 2 * tig;
        if (ra < n) {
            float* oa = out + ((size_t)ra * q_heads + h) * vd + d;
            oa[0] = o[nt][0] * inv[0];
            oa[1] = o[nt][1] * inv[0];
        }
        if (rb < n) {
            float* ob = out + ((size_t)rb * q_heads + h) * vd + d;
            ob[0] = o[nt][2] * inv[1];
            ob[1] = o[nt][3] * inv[1];
        }
    }
#endif
}

#define ATTENTION_MMA_ARGS                                                                                   \
    const float *k, const float *v, int heads, int kd, int vd, int v_row, int v_head, const float *q, int q_stride, \
        int q_heads, int n, int pos0, float scale, float *out, int chunk, float *part, int *tickets
#define ATTENTION_MMA_PASS k, v, heads, kd, vd, v_row, v_head, q, q_stride, q_heads, n, pos0, scale, out, chunk, part, tickets

extern "C" __global__ void attention_mma(ATTENTION_MMA_ARGS) {
    PDL_START;
    attention_mma_body<0>(ATTENTION_MMA_PASS);
}

// Heads of 128 (keys and values), the common size. Four blocks an SM: unbounded it took 138
// registers (three blocks, 1.6 waves of 640 blocks for 512 tokens); at 128 it spills 8 bytes.
extern "C" __global__ void __launch_bounds__(128, 4) attention_mma_d128(ATTENTION_MMA_ARGS) {
    PDL_START;
    attention_mma_body<128>(ATTENTION_MMA_PASS);
}
