// DeepSeek Sparse Attention (GLM-5), appended to kernels.cu (whose helpers it uses).

// LayerNorm in place over one segment of `dim` floats per row (block r: row r, at r * xs + xo):
// (x - mean) / sqrt(var + eps) * w + b, the indexer key's norm.
extern "C" __global__ void layer_norm(float* x, int xs, int xo, int dim, const float* w, const float* b, float eps) { PDL_START;
    float* row = x + (size_t)blockIdx.x * xs + xo;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += row[i];
    float mean = block_sum(s) / dim;
    float v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v += (row[i] - mean) * (row[i] - mean);
    float inv = rsqrtf(block_sum(v) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) row[i] = (row[i] - mean) * inv * w[i] + b[i];
}

// The indexer's scores: out[t * total + j] = sum_h w[t, h] * relu(q[t, h, :] . keys[j, :]) for
// the keys j < (pos0 + t + 1) / rate that query t sees (rate 1: a key per position, GLM-5;
// DeepSeek-V4's keys are entries of `rate` positions), -inf for the rest of its row. q rows are
// heads * d floats, w rows heads, both from the call's first row; keys are d floats a position.
// Grid (queries, position blocks of blockDim); dynamic shared memory holds the query and its
// weights (heads * (d + 1) floats).
extern "C" __global__ void index_scores(const float* keys, int d, const float* q, const float* w, int heads, int pos0,
                                        int rate, int total, float* out) { PDL_START;
    extern __shared__ float qw[];
    int t = blockIdx.x, hd = heads * d;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) qw[e] = q[(size_t)t * hd + e];
    for (int e = threadIdx.x; e < heads; e += blockDim.x) qw[hd + e] = w[(size_t)t * heads + e];
    __syncthreads();
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= total) return;
    if (j >= (pos0 + t + 1) / rate) {
        out[(size_t)t * total + j] = NEG_INF;
        return;
    }
    const float* k = keys + (size_t)j * d;
    float s = 0.0f;
    for (int h = 0; h < heads; h++) {
        float dot = 0.0f;
        for (int i = 0; i < d; i++) dot += qw[h * d + i] * k[i];
        s += qw[hd + h] * fmaxf(dot, 0.0f);
    }
    out[(size_t)t * total + j] = s;
}

// dst[i, :] = src[rows[i], :] for `count` rows of `width` floats (one block a row): a query's
// selected keys and values, gathered so that dense attention runs over them.
extern "C" __global__ void gather_rows(const float* src, int width, const unsigned* rows, int count, float* dst) { PDL_START;
    int i = blockIdx.x;
    if (i >= count) return;
    const float* s = src + (size_t)rows[i] * width;
    float* o = dst + (size_t)i * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = s[c];
}
