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
