// Gated DeltaNet (Qwen3-Next's linear attention), appended to kernels.cu (whose helpers it
// uses): the recurrence of transformers' `torch_recurrent_gated_delta_rule`, token by token,
// for every call (the CPU's chunked form for prefill gives the same values up to rounding, and
// either leaves a state the other continues from). Rows of x are [q | k | v | z | b | a], the
// state is the convolution's last taps - 1 inputs per channel, then each value head's
// key_dim x value_dim matrix (see smoe_engine::backend::DeltaNetParams).

__device__ __forceinline__ float delta_silu(float x) { return x / (1.0f + expf(-x)); }

// The causal convolution with SiLU, a thread per channel: y[t][ch] for rows 0..n of x (stride
// apart), continuing from the inputs `cs` holds (kept = taps - 1 rows of c, oldest first;
// zeroed where fresh), which it leaves holding the last inputs. Taps summed in order.
extern "C" __global__ void delta_conv(const float* x, int stride, int n, const float* conv, int taps, int c, float* cs,
                                      int fresh, float* y) { PDL_START;
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    int kept = taps - 1;
    if (fresh)
        for (int i = 0; i < kept; i++) cs[(size_t)i * c + ch] = 0.0f;
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < taps; j++) {
            int i = t + j;
            float in = i < kept ? cs[(size_t)i * c + ch] : x[(size_t)(i - kept) * stride + ch];
            acc += conv[ch * taps + j] * in;
        }
        y[(size_t)t * c + ch] = delta_silu(acc);
    }
    // The window's last `kept` inputs, oldest first (a row moves only to an earlier one).
    for (int i = 0; i < kept; i++) {
        int src = n + i;
        cs[(size_t)i * c + ch] = src < kept ? cs[(size_t)src * c + ch] : x[(size_t)(src - kept) * stride + ch];
    }
}

// q and k heads of y (rows of c) to unit L2 norm (epsilon 1e-6 under the root), q also times
// 1/sqrt(kd), as transformers' l2norm: a warp per (row, head) of the 2 * kh heads.
extern "C" __global__ void delta_l2norm(float* y, int n, int c, int kh, int kd) { PDL_START;
    int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (w >= n * 2 * kh) return;
    int t = w / (2 * kh), h = w % (2 * kh);
    float* v = y + (size_t)t * c + (size_t)h * kd;
    float ss = 0.0f;
    for (int i = lane; i < kd; i += 32) ss += v[i] * v[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    float inv = (h < kh ? 1.0f / sqrtf((float)kd) : 1.0f) / sqrtf(ss + 1e-6f);
    for (int i = lane; i < kd; i += 32) v[i] *= inv;
}

// Value head blockIdx.x, a thread per state column (blockDim.x: vd rounded up to 32; the
// threads past vd only join the block's sums): token by token, S <- exp(g) S, m = S^T k,
// delta = beta (v - m), S <- S + k (x) delta, o = S^T q; then o RMS-normed with `norm` and
// gated by silu(z) into out (rows of vh * vd). Column c of S only ever meets column c of m,
// delta and o, so a thread walks its column down the rows in order, as the CPU does: the same
// operations per element. The token's q and k are shared through shared memory (dynamic:
// 2 * kd floats).
extern "C" __global__ void delta_heads(const float* y, const float* x, int stride, int n, int c, int kh, int vh, int kd,
                                       int vd, int tiled, const float* neg_a, const float* dt_bias, const float* norm,
                                       float eps, float* s, int fresh, float* out) { PDL_START;
    extern __shared__ float qk[];
    int j = blockIdx.x, col = threadIdx.x;
    bool live = col < vd;
    int kh_of = tiled ? j % kh : j / (vh / kh);
    int vw = vh * vd;
    float* sj = s + (size_t)j * kd * vd;
    if (fresh && live)
        for (int i = 0; i < kd; i++) sj[(size_t)i * vd + col] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float* row = y + (size_t)t * c;
        const float* xin = x + (size_t)t * stride;
        __syncthreads();  // the previous token's q and k are read
        for (int i = col; i < kd; i += blockDim.x) {
            qk[i] = row[kh_of * kd + i];
            qk[kd + i] = row[(kh + kh_of) * kd + i];
        }
        __syncthreads();
        float acc = 0.0f;
        if (live) {
            float v = row[2 * kh * kd + j * vd + col];
            float beta = 1.0f / (1.0f + expf(-xin[c + vw + j]));
            float g = xin[c + vw + vh + j] + dt_bias[j];
            float decay = expf(neg_a[j] * (g > 20.0f ? g : log1pf(expf(g))));
            float m = 0.0f;
            for (int i = 0; i < kd; i++) {
                float e = sj[(size_t)i * vd + col] * decay;
                sj[(size_t)i * vd + col] = e;
                m += e * qk[kd + i];
            }
            float d = (v - m) * beta;
            for (int i = 0; i < kd; i++) {
                float e = sj[(size_t)i * vd + col] + qk[kd + i] * d;
                sj[(size_t)i * vd + col] = e;
                acc += e * qk[i];
            }
        }
        float inv = 1.0f / sqrtf(block_sum(acc * acc) / vd + eps);
        if (live) out[(size_t)t * vw + j * vd + col] = acc * inv * norm[col] * delta_silu(xin[c + j * vd + col]);
    }
}

// x[t * width + i] *= sigmoid(gate[t * gs + go + i]): Qwen3-Next's gated attention output.
extern "C" __global__ void sigmoid_gate(float* x, int n, int width, const float* gate, int gs, int go) { PDL_START;
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n * width) return;
    int t = e / width, i = e % width;
    x[e] = x[e] / (1.0f + expf(-gate[(size_t)t * gs + go + i]));
}
