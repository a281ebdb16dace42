// Fused kernels of the decode path, appended to kernels.cu (whose helpers they use).
//
// A decoded token runs a few dozen small ops per layer; on the H200 each costs a launch and a
// ramp of its own, and Nsight Compute found a layer's dozen small kernels (norms, RoPE, KV
// copies, quantizing inputs) taking longer together than its products. Each kernel here does
// what two to six of them did, with the same arithmetic in the same order per element.

// x[t] += y[t], then out[t] = x[t] / rms * w (and, with qx, quantized as `rms_norm` does): the
// residual add of a sublayer and the next norm. One block per row (norm_row).
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, int dim, float eps,
                                        u8* qx, int qstride) { PDL_START;
    size_t r = blockIdx.x;
    norm_row(x + r * dim, y + r * dim, w, out + r * dim, dim, eps, qx ? qx + r * qstride : nullptr, blockDim.x);
}

// Standard attention's inputs, in rows of `stride` holding q_heads query heads, then kv_heads
// key heads, then kv_heads value heads, each hd wide: every q and k head normalised over its hd
// values (with qn / kn, where the model has per-head norms), rotated (cs: n * half cosines,
// then n * half sines; pairs (p, p + half), or (2p, 2p + 1) interleaved), written back, and the
// keys and values of token t stored at position pos0 + t of the caches (rows of kv_heads * hd).
// One warp per (token, head), four a block; hd <= 512. (A block per head, its sum over the
// block's warps with two barriers, took 52 µs a layer for a 512-token chunk of the 30B shape.)
// One (token, head) of qk_rope_store, a warp's: row t of x, row t of the tables (of n rows),
// stored at cache row `pos` (of kc and vc).
__device__ __forceinline__ void qk_rope_one(float* x, int stride, int q_heads, int kv_heads, int hd, const float* qn,
                                            const float* kn, float eps, const float* cs, int n, int half,
                                            int interleaved, float* kc, float* vc, int t, int h, int pos,
                                            float* v) {
    int lane = threadIdx.x % 32;
    float* head = x + (size_t)t * stride + (size_t)h * hd;
    size_t kv_row = (size_t)pos * kv_heads * hd;
    if (h >= q_heads + kv_heads) {  // a value head: stored as it is
        float* dst = vc + kv_row + (size_t)(h - q_heads - kv_heads) * hd;
        for (int i = lane; i < hd; i += 32) dst[i] = head[i];
        return;
    }
    const float* w = h < q_heads ? qn : kn;
    for (int i = lane; i < hd; i += 32) v[i] = head[i];
    if (w) {  // as rms_norm_heads
        float s = 0.0f;
        for (int i = lane; i < hd; i += 32) s += v[i] * v[i];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        float scale = rsqrtf(s / hd + eps);
        for (int i = lane; i < hd; i += 32) v[i] = w[i] * (v[i] * scale);
    }
    __syncwarp();
    for (int p = lane; p < half; p += 32) {  // as rope
        float c = cs[t * half + p], sn = cs[n * half + t * half + p];
        int ia = interleaved ? 2 * p : p, ib = interleaved ? 2 * p + 1 : p + half;
        float a = v[ia], b = v[ib];
        v[ia] = a * c - b * sn;
        v[ib] = b * c + a * sn;
    }
    __syncwarp();
    float* key = h >= q_heads ? kc + kv_row + (size_t)(h - q_heads) * hd : nullptr;
    for (int i = lane; i < hd; i += 32) {
        head[i] = v[i];
        if (key) key[i] = v[i];
    }
}

extern "C" __global__ void qk_rope_store(float* x, int stride, int q_heads, int kv_heads, int hd, const float* qn,
                                         const float* kn, float eps, const float* cs, int n, int half,
                                         int interleaved, float* kc, float* vc, int pos0) { PDL_START;
    __shared__ float vw[4][512];
    int per = q_heads + 2 * kv_heads;
    int item = blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= n * per) return;  // the whole warp; no block-wide barrier follows
    int t = item / per, h = item % per;
    qk_rope_one(x, stride, q_heads, kv_heads, hd, qn, kn, eps, cs, n, half, interleaved, kc, vc, t, h, pos0 + t,
                vw[threadIdx.x / 32]);
}

// qk_rope_store of the sequences of a step at once (`SeqKv`: each one's rows of x and its own
// caches; cs holds the tables of all n rows): every (token, head) as alone. One launch takes
// the `rows` rows from t0 that its table's sequences (at most MAX_SEQS) hold.
extern "C" __global__ void qk_rope_store_seqs(float* x, int stride, int q_heads, int kv_heads, int hd,
                                              const float* qn, const float* kn, float eps, const float* cs, int n,
                                              int half, int interleaved, int t0, int rows, const SeqKvs ss) { PDL_START;
    __shared__ float vw[4][512];
    int per = q_heads + 2 * kv_heads;
    int item = blockIdx.x * 4 + threadIdx.x / 32;
    if (item >= rows * per) return;  // the whole warp; no block-wide barrier follows
    int t = t0 + item / per, h = item % per;
    const SeqKv& s = ss.s[seq_of(ss, t)];
    qk_rope_one(x, stride, q_heads, kv_heads, hd, qn, kn, eps, cs, n, half, interleaved, (float*)s.k, (float*)s.v, t,
                h, s.pos0 + t - s.row, vw[threadIdx.x / 32]);
}

// Rows 0..rows of x ([gate | up], w each, rows `stride` apart): gate = silu(gate) * up, as
// silu_mul_halves, and the result quantized (as quantize_rows would) into qx, rows qstride
// apart: the kept experts' down products read it there. One warp per group of 32 (w a
// multiple of 32).
extern "C" __global__ void silu_quantize(float* x, int stride, int rows, int w, u8* qx, int qstride) { PDL_START;
    int groups = w / 32;
    int gi = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (gi >= rows * groups) return;
    int r = gi / groups, g = gi % groups, c = 32 * g + threadIdx.x % 32;
    float* row = x + (size_t)r * stride;
    float a = row[c];
    float v = a / (1.0f + expf(-a)) * row[w + c];
    row[c] = v;
    quantize_group(v, qx + (size_t)r * qstride, w, g);
}

// Up to MV_TOKENS tokens through f32 weights (a router, most often: 128 rows of 2048), a block
// of threads per row, so that a matrix of few rows still spreads over every SM (the warp-per-row
// mat-vec gave a router 32 blocks on 132 SMs: one token's took as long as a layer's expert
// products, eight tokens' 57 µs, a quarter of an 8-sequence decode step on an H100). The row's
// weights load once for all the tokens; each token is summed as it is alone, in a fixed order
// (a thread's columns in turn, then the block's sum): a token gets its one-token bits in any
// batch of up to eight whose rows' stride is a multiple of 4 floats (every hidden width here;
// else the batch takes the scalar loop, see `wide`), and of up to 64 where the backend splits
// the product into 8-token launches (`resident_jobs`, on int8 activations). The host sends no
// more than MV_TOKENS.
// Row r of job j (r < j.rows), the block's.
__device__ void mvs_f32_row(const Job& j, int r, const float* x, int xs, float* out, int os) {
    const float* w = (const float*)(j.w + (u64)r * j.row_bytes);
    const float* xr = x + (size_t)j.x_row * xs;
    int n = min(j.n, MV_TOKENS);
    float s[MV_TOKENS];
#pragma unroll
    for (int t = 0; t < MV_TOKENS; t++) s[t] = 0.0f;
    // A token alone takes the float4 loop where its row and the weights are 16-byte aligned;
    // so does each token here, all together only where every one of them is.
    bool wide = (((size_t)w | (size_t)xr) & 15) == 0 && (j.cols & 3) == 0 && (n == 1 || (xs & 3) == 0);
    if (wide) {
        for (int c = 4 * threadIdx.x; c < j.cols; c += 4 * blockDim.x) {
            float4 a = *(const float4*)(w + c);
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++)
                if (t < n) {
                    float4 b = *(const float4*)(xr + (size_t)t * xs + c);
                    s[t] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                }
        }
    } else {
        for (int c = threadIdx.x; c < j.cols; c += blockDim.x) {
            float a = w[c];
#pragma unroll
            for (int t = 0; t < MV_TOKENS; t++)
                if (t < n) s[t] += a * xr[(size_t)t * xs + c];
        }
    }
#pragma unroll
    for (int t = 0; t < MV_TOKENS; t++)
        if (t < n) {
            float v = block_sum(s[t]);
            if (threadIdx.x == 0) out[(size_t)(j.out_row + t) * os + j.out_col + r] = v;
        }
}

// Row r of job j, asked of L2 while the kernel before runs (see mvq_prefetch), where js asks.
__device__ __forceinline__ void mvs_f32_prefetch(const Jobs& js, const Job& j, int r) {
    if (js.prefetch && threadIdx.x == 0 && r < j.rows) prefetch_l2((const void*)(j.w + (u64)r * j.row_bytes), j.row_bytes);
}

extern "C" __global__ void mvs_f32(const Jobs js, const float* x, int xs, float* out, int os) {
    const Job& j = js.job[blockIdx.y];
    int r = blockIdx.x;
    mvs_f32_prefetch(js, j, r);
    PDL_START;
    if (r < j.rows) mvs_f32_row(j, r, x, xs, out, os);
}

// The last block of a kernel to finish (a ticket, left at 0 for the next launch), after every
// block's writes are seen: true in that block only (all its threads).
__device__ bool last_block(int* ticket) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == (int)(gridDim.x * gridDim.y) - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        if (threadIdx.x == 0) *ticket = 0;
    }
    return last;
}

// A decoded token's router product (mvs_f32 of one job, one token: its logits at out[0..e))
// and its routing (`route`) in one launch: the last block to finish (last_block) routes the
// token with warp 0, reading the logits the other blocks wrote through L2. One launch, and one
// wait on the kernel before, fewer a layer than the two kernels, meant to give the same bits.
// Dynamic shared memory as `route`'s. Opt-in (SMOE_CUDA_FUSED_ROUTE=on): the same bits on an
// H100, but no faster than the two kernels there.
extern "C" __global__ void mvs_f32_route(const Jobs js, const float* x, int xs, float* out, int os, int e,
                                         const float* bias, int sigmoid, int n_group, int topk_group, int k, int norm,
                                         float scaling, float* routes, int* ticket) {
    const Job& j = js.job[0];
    int r = blockIdx.x;
    mvs_f32_prefetch(js, j, r);
    PDL_START;
    if (r < j.rows) mvs_f32_row(j, r, x, xs, out, os);
    if (last_block(ticket) && threadIdx.x < 32)
        route_token(out, e, bias, sigmoid, n_group, topk_group, k, norm, scaling, routes, 0, threadIdx.x);
}

// A decoded token's sublayer output product (mvq of one job, one token, into y[0..rows)) and
// the residual add and norm after it (add_rms_norm of that row into x and out) in one launch:
// the last block to finish (last_block) adds and norms the row with add_rms_norm's bits
// (norm_row). One launch, and one wait on the kernel before, fewer a layer than the two.
template <int F>
__device__ void mvq_add_norm(const Jobs& js, const u8* qx, int qstride, float* y, float* x, const float* w,
                             float* out, float eps, u8* oq, int threads, int* ticket) {
    const Job& j = js.job[0];
    mvq<F, 1>(j, qx, qstride, 0, y, j.rows);
    if (last_block(ticket)) norm_row(x, y, w, out, j.rows, eps, oq, threads);
}

#define ADD_NORM_KERNEL(name, id)                                                                               \
    extern "C" __global__ void mvq_add_norm_##name(const Jobs js, const u8* qx, int qstride, float* y, float* x, \
                                                   const float* w, float* out, float eps, u8* oq, int threads,   \
                                                   int* ticket) {                                                \
        mvq_prefetch<id>(js);                                                                                    \
        PDL_START;                                                                                               \
        mvq_add_norm<id>(js, qx, qstride, y, x, w, out, eps, oq, threads, ticket);                              \
    }
ADD_NORM_KERNEL(q8_0, 8)
ADD_NORM_KERNEL(q4_k, 12)
ADD_NORM_KERNEL(q6_k, 14)
