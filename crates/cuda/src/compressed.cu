// DeepSeek-V4 on the GPU, appended to kernels.cu (whose helpers it uses): the compressor that
// pools closed windows into entries, the attention over a sliding window and entries, the
// hyper-connections' stream mixing and the experts' clipped SwiGLU.

// One closed window a block: entry `first + blockIdx.x` (dim floats, written to `entries`) pools
// each channel over the window's raw rows (`[kv | gate]`, 2 * cw floats a position, cw = dim, or
// 2 * dim with `overlap`) as a softmax over gate + bias, the previous window's first halves
// before this window's second halves where windows overlap (window 0 has no predecessor); then
// the entry's RMSNorm and the rotation of its last 2 * half dimensions (interleaved pairs, the
// window's cosines and sines at cos/sin + blockIdx.x * half). Dynamic shared memory: dim floats.
extern "C" __global__ void compress_windows(const float* raw, float* entries, int first, int rate, int dim, int overlap,
                                            const float* bias, const float* norm, float eps, const float* cos,
                                            const float* sin, int half) { PDL_START;
    extern __shared__ float e[];
    int w = first + blockIdx.x;
    int cw = overlap ? 2 * dim : dim, row = 2 * cw;
    int has_prev = overlap && w > 0;
    for (int ch = threadIdx.x; ch < dim; ch += blockDim.x) {
        int col = overlap ? dim + ch : ch;
        // In the host's order: the previous window's slots, then this window's.
        float m = NEG_INF;
        for (int i = 0; i < rate && has_prev; i++)
            m = fmaxf(m, raw[(size_t)((w - 1) * rate + i) * row + cw + ch] + bias[i * cw + ch]);
        for (int i = 0; i < rate; i++) m = fmaxf(m, raw[(size_t)(w * rate + i) * row + cw + col] + bias[i * cw + col]);
        float num = 0.0f, den = 0.0f;
        for (int i = 0; i < rate && has_prev; i++) {
            const float* r = raw + (size_t)((w - 1) * rate + i) * row;
            float p = exp_rounded(r[cw + ch] + bias[i * cw + ch] - m);
            num += p * r[ch];
            den += p;
        }
        for (int i = 0; i < rate; i++) {
            const float* r = raw + (size_t)(w * rate + i) * row;
            float p = exp_rounded(r[cw + col] + bias[i * cw + col] - m);
            num += p * r[col];
            den += p;
        }
        e[ch] = num / den;
    }
    __syncthreads();
    float s = 0.0f;
    for (int ch = threadIdx.x; ch < dim; ch += blockDim.x) s += e[ch] * e[ch];
    float scale = rsqrtf(block_sum(s) / dim + eps);
    for (int ch = threadIdx.x; ch < dim; ch += blockDim.x) e[ch] *= scale * norm[ch];
    __syncthreads();
    float* o = entries + (size_t)w * dim;
    int rot0 = dim - 2 * half;
    const float* c = cos + (size_t)blockIdx.x * half;
    const float* sn = sin + (size_t)blockIdx.x * half;
    for (int ch = threadIdx.x; ch < dim; ch += blockDim.x) {
        if (ch < rot0) {
            o[ch] = e[ch];
        } else {
            int p = (ch - rot0) / 2;
            float a = e[rot0 + 2 * p], b = e[rot0 + 2 * p + 1];
            o[ch] = (ch - rot0) % 2 == 0 ? a * c[p] - b * sn[p] : b * c[p] + a * sn[p];
        }
    }
}

#define CA_WARPS 4
#define CA_LANE_DIMS 16  // dimensions per lane: heads of at most 512

// DeepSeek-V4's attention of query t (blockIdx.x, at position pos0 + t) in head h (blockIdx.y):
// over the window's rows (`win`, positions max(0, pos + 1 - window)..=pos, d floats a position)
// and then the entries it sees (`ent`, d floats each: the first (pos + 1) / rate, or those its
// row of `sel` names, `top` a query, u32 max after its last), keys equal to values, one softmax
// with the head's sink. Each warp takes every CA_WARPS-th row with an online softmax, a lane
// holding every 32nd dimension; the warps are merged at the end. q and out rows: heads * d.
extern "C" __global__ void attention_compressed(const float* win, const float* ent, int d, const float* q, int heads,
                                                int pos0, int window, int rate, const unsigned* sel, int top,
                                                const float* sinks, float scale, float* out) { PDL_START;
    __shared__ float wm[CA_WARPS], ws[CA_WARPS];
    __shared__ float wacc[CA_WARPS][32 * CA_LANE_DIMS];
    int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int pos = pos0 + t;
    int first = max(0, pos + 1 - window);
    int wc = pos + 1 - first;
    int seen = rate > 0 ? (pos + 1) / rate : 0;
    const unsigned* mine = sel ? sel + (size_t)t * top : nullptr;
    int ec = seen;
    if (mine) {
        ec = 0;
        while (ec < top && mine[ec] < (unsigned)seen) ec++;
    }
    const float* qh = q + ((size_t)t * heads + h) * d;
    float qv[CA_LANE_DIMS], acc[CA_LANE_DIMS];
#pragma unroll
    for (int i = 0; i < CA_LANE_DIMS; i++) {
        int c = lane + 32 * i;
        qv[i] = c < d ? qh[c] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, s = 0.0f;
    for (int r = warp; r < wc + ec; r += CA_WARPS) {
        const float* k = r < wc ? win + (size_t)(first + r) * d : ent + (size_t)(mine ? mine[r - wc] : r - wc) * d;
        float kv[CA_LANE_DIMS];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < CA_LANE_DIMS; i++) {
            int c = lane + 32 * i;
            kv[i] = c < d ? k[c] : 0.0f;
            dot += qv[i] * kv[i];
        }
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
        float sc = dot * scale;
        float nm = fmaxf(m, sc);
        float corr = expf(m - nm), p = expf(sc - nm);
        s = s * corr + p;
#pragma unroll
        for (int i = 0; i < CA_LANE_DIMS; i++) acc[i] = acc[i] * corr + p * kv[i];
        m = nm;
    }
    if (lane == 0) wm[warp] = m, ws[warp] = s;
#pragma unroll
    for (int i = 0; i < CA_LANE_DIMS; i++) wacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float sink = sinks[h];
    float mx = sink;
    for (int w = 0; w < CA_WARPS; w++) mx = fmaxf(mx, wm[w]);
    float den = expf(sink - mx);
    for (int w = 0; w < CA_WARPS; w++) den += ws[w] * expf(wm[w] - mx);
    float* o = out + ((size_t)t * heads + h) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float num = 0.0f;
        for (int w = 0; w < CA_WARPS; w++) num += wacc[w][c] * expf(wm[w] - mx);
        o[c] = num / den;
    }
}

// Hyper-connections' collapse: out[t, c] = sum_j pre[t * mult + j] * x[t, j, c], a thread per
// output value.
extern "C" __global__ void hc_collapse(const float* x, int n, int mult, int dim, const float* pre, float* out) { PDL_START;
    size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (size_t)n * dim) return;
    int t = e / dim, c = e % dim;
    float a = 0.0f;
    for (int j = 0; j < mult; j++) a += pre[t * mult + j] * x[((size_t)t * mult + j) * dim + c];
    out[e] = a;
}

#define HC_MAX_STREAMS 16

// Hyper-connections' expansion in place: x[t, k, c] = post[t, k] * y[t, c] + sum_j comb[t, j, k] *
// x[t, j, c], a thread per (t, c) reading its mult old values before writing any.
extern "C" __global__ void hc_expand(float* x, const float* y, int n, int mult, int dim, const float* post,
                                     const float* comb) { PDL_START;
    size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (size_t)n * dim) return;
    int t = e / dim, c = e % dim;
    float old[HC_MAX_STREAMS];
    float* row = x + (size_t)t * mult * dim + c;
    for (int j = 0; j < mult; j++) old[j] = row[(size_t)j * dim];
    const float* cb = comb + (size_t)t * mult * mult;
    for (int k = 0; k < mult; k++) {
        float v = post[t * mult + k] * y[e];
        for (int j = 0; j < mult; j++) v += cb[j * mult + k] * old[j];
        row[(size_t)k * dim] = v;
    }
}

__device__ __forceinline__ float clamped_silu(float g, float u, float limit) {
    g = fminf(g, limit);
    return g * (1.0f / (1.0f + exp_rounded(-g))) * fminf(fmaxf(u, -limit), limit);
}

// DeepSeek-V4's clipped SwiGLU: g[i] = silu(min(g[i], limit)) * clamp(u[i], -limit, limit), for
// `rows` rows of `w` values at g + r * gs and u + r * us.
extern "C" __global__ void silu_clamped(float* g, int gs, const float* u, int us, int rows, int w, float limit) { PDL_START;
    size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (size_t)rows * w) return;
    int r = e / w, c = e % w;
    float* gp = g + (size_t)r * gs + c;
    *gp = clamped_silu(*gp, u[(size_t)r * us + c], limit);
}
