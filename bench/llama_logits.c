/* Logits llama.cpp computes for a sequence of token ids, one prefill, every position.
 * Usage: llama_logits MODEL.gguf IDS_FILE OUT.f32 [threads]
 * IDS_FILE: whitespace-separated token ids. OUT.f32: [n_tokens, n_vocab] little-endian f32.
 * Built against a llama.cpp build by bench/gguf_quant.py (not part of smoe). */
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf IDS_FILE OUT.f32 [threads]\n", argv[0]);
        return 2;
    }
    FILE *fi = fopen(argv[2], "r");
    if (!fi) { perror(argv[2]); return 1; }
    int cap = 1 << 16, n = 0;
    llama_token *ids = malloc(sizeof(llama_token) * cap);
    while (n < cap && fscanf(fi, "%d", &ids[n]) == 1) n++;
    fclose(fi);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + 8;
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
    if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *fo = fopen(argv[3], "wb");
    if (!fo) { perror(argv[3]); return 1; }
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), vocab, fo);
    fclose(fo);
    fprintf(stderr, "wrote %d x %d logits\n", n, vocab);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
