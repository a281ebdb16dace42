/* Logits llama.cpp computes for a sequence of token ids, one prefill, every position; then,
 * optionally, a greedy continuation.
 * Usage: llama_logits MODEL.gguf IDS_FILE OUT.f32 [threads] [greedy]
 * IDS_FILE: whitespace-separated token ids (at most 65536). OUT.f32: [n_tokens, n_vocab]
 * little-endian f32. With greedy = G > 0, G tokens follow the prefill, each the argmax of the
 * last logits (lowest id on ties) fed back alone at the next position; their ids are written,
 * whitespace-separated, to OUT.f32.greedy (a text file).
 * Timings go to stderr: "prefill N tokens in S s", "greedy G tokens (G-1 decode steps) in S s".
 * Built against a llama.cpp build by bench/gguf_quant.py and bench/peer.py (not part of smoe). */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static llama_token argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf IDS_FILE OUT.f32 [threads] [greedy]\n", argv[0]);
        return 2;
    }
    FILE *fi = fopen(argv[2], "r");
    if (!fi) { perror(argv[2]); return 1; }
    int cap = 1 << 16, n = 0, extra;
    llama_token *ids = malloc(sizeof(llama_token) * cap);
    while (n < cap && fscanf(fi, "%d", &ids[n]) == 1) n++;
    if (n == cap && fscanf(fi, "%d", &extra) == 1) fprintf(stderr, "warning: only the first %d ids are used\n", cap);
    fclose(fi);
    if (n == 0) { fprintf(stderr, "no token ids in %s\n", argv[2]); return 1; }
    int greedy = argc > 5 ? atoi(argv[5]) : 0;
    if (greedy < 0) greedy = 0;
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) { fprintf(stderr, "id %d at %d is outside the vocabulary (%d)\n", ids[i], i, vocab); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + greedy + 8;
    cp.n_batch = n;
    cp.n_ubatch = n;
    cp.no_perf = 1;
    if (argc > 4) cp.n_threads = cp.n_threads_batch = atoi(argv[4]);
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = ids[i];
        b.pos[i] = i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    b.n_tokens = n;
    double t0 = now();
    if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    fprintf(stderr, "prefill %d tokens in %.3f s\n", n, now() - t0);
    FILE *fo = fopen(argv[3], "wb");
    if (!fo) { perror(argv[3]); return 1; }
    for (int i = 0; i < n; i++)
        if (fwrite(llama_get_logits_ith(ctx, i), sizeof(float), vocab, fo) != (size_t)vocab) { perror(argv[3]); return 1; }
    if (fclose(fo) != 0) { perror(argv[3]); return 1; }
    fprintf(stderr, "wrote %d x %d logits\n", n, vocab);
    if (greedy > 0) {
        llama_token *gen = malloc(sizeof(llama_token) * greedy);
        llama_token next = argmax(llama_get_logits_ith(ctx, n - 1), vocab);
        t0 = now();
        for (int g = 0; g < greedy; g++) {
            gen[g] = next;
            if (g + 1 == greedy) break; /* the last token's own logits are not needed */
            b.token[0] = next;
            b.pos[0] = n + g;
            b.n_seq_id[0] = 1;
            b.seq_id[0][0] = 0;
            b.logits[0] = 1;
            b.n_tokens = 1;
            if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed at greedy step %d\n", g); return 1; }
            next = argmax(llama_get_logits_ith(ctx, 0), vocab);
        }
        fprintf(stderr, "greedy %d tokens (%d decode steps) in %.3f s\n", greedy, greedy - 1, now() - t0);
        size_t len = strlen(argv[3]);
        char *path = malloc(len + sizeof(".greedy"));
        memcpy(path, argv[3], len);
        memcpy(path + len, ".greedy", sizeof(".greedy"));
        FILE *fg = fopen(path, "w");
        if (!fg) { perror(path); return 1; }
        for (int g = 0; g < greedy; g++) fprintf(fg, g ? " %d" : "%d", gen[g]);
        fputc('\n', fg);
        if (fclose(fg) != 0) { perror(path); return 1; }
        free(path);
        free(gen);
    }
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    free(ids);
    return 0;
}
