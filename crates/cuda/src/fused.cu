// Fused kernels of the decode path, appended to kernels.cu (whose helpers they use).
//
// A decoded token runs a few dozen small ops per layer; on the H200 each costs a launch and a
// ramp of its own, and Nsight Compute found a layer's dozen small kernels (norms, RoPE, KV
// copies, quantizing inputs) taking longer together than its products. Each kernel here does
// what two to six of them did, with the same arithmetic in the same order per element.

// x[t] += y[t], then out[t] = x[t] / rms * w (and, with qx, quantized as `rms_norm` does): the
// residual add of a sublayer and the next norm. One block per row; each element is added,
// stored and normalised by the same thread.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, int dim, float eps,
                                        u8* qx, int qstride) { PDL_START;
    float* row = x + (size_t)blockIdx.x * dim;
    const float* yr = y + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = row[i] + yr[i];
        row[i] = v;
        s += v * v;
    }
    float scale = rsqrtf(block_sum(s) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = w[i] * (row[i] * scale);
        o[i] = v;
        if (qx) quantize_group(v, qx + (size_t)blockIdx.x * qstride, dim, i / 32);
    }
}

// Standard attention's inputs, in rows of `stride` holding q_heads query heads, then kv_heads
// key heads, then kv_heads value heads, each hd wide: every q and k head normalised over its hd
// values (with qn / kn, where the model has per-head norms), rotated (cs: n * half cosines,
// then n * half sines; pairs (p, p + half), or (2p, 2p + 1) interleaved), written back, and the
// keys and values of token t stored at position pos0 + t of the caches (rows of kv_heads * hd).
// One warp per (token, head), four a block; hd <= 512. (A block per head, its sum over the
// block's warps with two barriers, took 52 µs a layer for a 512-token chunk of the 30B shape.)
// One (token, head) of qk_rope_store, a warp's: row t of x, row t of the tables (of n rows),
// stored at cache row `pos` (of kc and vc). `cg`: x read past L1 (other blocks of the launch
// wrote it).
__device__ __forceinline__ void qk_rope_one(float* x, int stride, int q_heads, int kv_heads, int hd, const float* qn,
                                            const float* kn, float eps, const float* cs, int n, int half,
                                            int interleaved, float* kc, float* vc, int t, int h, int pos,
                                            float* v, bool cg = false) {
    int lane = threadIdx.x % 32;
    float* head = x + (size_t)t * stride + (size_t)h * hd;
    size_t kv_row = (size_t)pos * kv_heads * hd;
    if (h >= q_heads + kv_heads) {  // a value head: stored as it is
        float* dst = vc + kv_row + (size_t)(h - q_heads - kv_heads) * hd;
        for (int i = lane; i < hd; i += 32) dst[i] = cg ? __ldcg(head + i) : head[i];
        return;
    }
    const float* w = h < q_heads ? qn : kn;
    for (int i = lane; i < hd; i += 32) v[i] = cg ? __ldcg(head + i) : head[i];
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

// One token through f32 weights (a router, most often: 128 rows of 2048), a block of threads
// per row, so that a matrix of few rows still spreads over every SM (the warp-per-row mat-vec
// gave a router 32 blocks on 132 SMs, and it took as long as a layer's expert products).
// Summed in a fixed order: the same bits every run.
// Row blockIdx.x of job blockIdx.y, a block's (rows past the job's: nothing).
__device__ __forceinline__ void mvs_f32_row(const Jobs& js, const float* x, int xs, float* out, int os) {
    const Job& j = js.job[blockIdx.y];
    int r = blockIdx.x;
    if (r >= j.rows) return;  // the whole block
    const float* w = (const float*)(j.w + (u64)r * j.row_bytes);
    const float* xr = x + (size_t)j.x_row * xs;
    float s = 0.0f;
    if ((((size_t)w | (size_t)xr) & 15) == 0 && (j.cols & 3) == 0) {
        for (int c = 4 * threadIdx.x; c < j.cols; c += 4 * blockDim.x) {
            float4 a = *(const float4*)(w + c), b = *(const float4*)(xr + c);
            s += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        for (int c = threadIdx.x; c < j.cols; c += blockDim.x) s += w[c] * xr[c];
    }
    s = block_sum(s);
    if (threadIdx.x == 0) out[(size_t)j.out_row * os + j.out_col + r] = s;
}

// One token through f32 weights (a router, most often: 128 rows of 2048), a block of threads
// per row, so that a matrix of few rows still spreads over every SM (the warp-per-row mat-vec
// gave a router 32 blocks on 132 SMs, and it took as long as a layer's expert products).
// Summed in a fixed order: the same bits every run.
extern "C" __global__ void mvs_f32(const Jobs js, const float* x, int xs, float* out, int os) { PDL_START;
    mvs_f32_row(js, x, xs, out, os);
}

// Whether this block is the last of `blocks` to arrive at `ticket` (a counter at zero before
// the launch, left at zero after it): what the blocks wrote before is then visible to it, read
// past L1 (`__ldcg`: a line another block of this SM read may be stale there). The block that
// finishes a launch's work does the small op that followed it in a launch of its own, and a
// wait for a launch goes. Every thread must call it.
__device__ bool last_to_arrive(unsigned* ticket, unsigned blocks) {
    __shared__ bool last;
    __threadfence();  // this thread's writes, before the ticket says they are done
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1u) == blocks - 1;
        // Launches on one stream never overlap (each waits for the one before): the next
        // launch that takes a ticket here finds it at zero.
        if (last) *ticket = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// A decoded token's router and routing in one launch: each block a row of the router's
// product, as mvs_f32 (one job, one token, out: the logits); the last block routes the token
// from them as `route` does (the same bits). Dynamic shared memory: 3 e + 2 k floats.
extern "C" __global__ void mvs_f32_route(const Jobs js, const float* x, int xs, float* out, int os, int e,
                                         const float* bias, int sigmoid, int n_group, int topk_group, int k,
                                         int norm, float scaling, float* routes, unsigned* ticket) { PDL_START;
    mvs_f32_row(js, x, xs, out, os);
    if (!last_to_arrive(ticket, gridDim.x * gridDim.y) || threadIdx.x >= 32) return;
    extern __shared__ float sh[];
    float* l = sh + 2 * e + 2 * k;
    for (int i = threadIdx.x; i < e; i += 32) l[i] = __ldcg(out + i);
    __syncwarp();
    route_token(l, e, bias, sigmoid, n_group, topk_group, k, norm, scaling, routes, sh);
}

// out = x / rms * w (and, with qx, quantized) over one row of `dim`, as the `rms_norm` kernel
// does with `threads` threads (norm_threads(dim) on the host): each of those threads' partial
// sums, reduced as block_sum reduces them, by however many threads this block has (a multiple
// of 32): the same bits from fewer threads. x read past L1 (written by other blocks).
__device__ void rms_norm_row_as(const float* x, const float* w, float* out, int dim, float eps, u8* qx, int threads) {
    __shared__ float part[32];
    int lane = threadIdx.x % 32;
    for (int vw = threadIdx.x / 32; vw < threads / 32; vw += blockDim.x / 32) {
        float s = 0.0f;
        for (int i = 32 * vw + lane; i < dim; i += threads) {
            float v = __ldcg(x + i);
            s += v * v;
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        if (lane == 0) part[vw] = s;
    }
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < threads / 32; i++) s += part[i];
    float scale = rsqrtf(s / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = w[i] * (__ldcg(x + i) * scale);
        out[i] = v;
        if (qx) quantize_group(v, qx, dim, i / 32);
    }
}

// A decoded token's q, k and v products (one token, jobs whose rows are whole heads) and, per
// head, the last of the head's blocks runs qk_rope_store's work on it (a ticket a head): the
// per-head norms, RoPE and the KV store follow their rows with no launch of their own.
struct RopeStore {
    const float* qn;  // per-head norms, or null
    const float* kn;
    const float* cs;  // the token's rotary table: half cosines, then half sines
    float* kc;        // the layer's caches
    float* vc;
    unsigned* tickets;  // one a head, at zero
    float eps;
    int q_heads, kv_heads, hd, half, interleaved, pos, block_rows;
};

// After the products into row 0 of out (os floats, `[q | k | v]`): this block's head, if its
// rows finished it.
__device__ void rope_store_tail(const Job& j, float* out, int os, const RopeStore& rs) {
    __shared__ float v[512];
    int r0 = blockIdx.x * rs.block_rows;
    if (r0 >= j.rows) return;  // a block past the job's rows (a shorter job of the launch)
    int h = (j.out_col + r0) / rs.hd;
    if (!last_to_arrive(rs.tickets + h, rs.hd / rs.block_rows) || threadIdx.x >= 32) return;
    qk_rope_one(out, os, rs.q_heads, rs.kv_heads, rs.hd, rs.qn, rs.kn, rs.eps, rs.cs, 1, rs.half, rs.interleaved, rs.kc,
                rs.vc, 0, h, rs.pos, v, true);
}

// A decoded token's output product (one job, one row) and, in the last block, the residual add
// with the next norm as add_rms_norm does it (the same bits).
struct AddNorm {
    float* x;  // the residual row
    const float* w;
    float* out;  // the norm's output row
    u8* q;       // its int8 copy, or null
    unsigned* ticket;
    float eps;
    int dim, threads;
};

__device__ void add_norm_tail(const float* y, const AddNorm& an) {
    if (!last_to_arrive(an.ticket, gridDim.x * gridDim.y)) return;
    for (int i = threadIdx.x; i < an.dim; i += blockDim.x) an.x[i] = an.x[i] + __ldcg(y + i);
    __syncthreads();
    rms_norm_row_as(an.x, an.w, an.out, an.dim, an.eps, an.q, an.threads);
}

#define TAIL_KERNELS(name, id)                                                                                   \
    extern "C" __global__ void mvq_rope_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out,      \
                                               int os, const RopeStore rs) {                                     \
        PDL_START;                                                                                               \
        mvq<id, 1>(js.job[blockIdx.y], qx, qstride, lo, out, os);                                                \
        rope_store_tail(js.job[blockIdx.y], out, os, rs);                                                        \
    }                                                                                                            \
    extern "C" __global__ void mvq_add_norm_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out,  \
                                                   int os, const AddNorm an) {                                   \
        PDL_START;                                                                                               \
        mvq<id, 1>(js.job[blockIdx.y], qx, qstride, lo, out, os);                                                \
        add_norm_tail(out, an);                                                                                  \
    }

TAIL_KERNELS(q8_0, 8)
TAIL_KERNELS(q4_k, 12)
