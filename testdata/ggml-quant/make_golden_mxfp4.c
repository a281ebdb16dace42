// ggml's quantize_row_mxfp4_ref on <dist>.f32 (16 rows of 512 values), written to <dist>.mxfp4.
// MXFP4 has no importance-matrix path, so this is what ggml_quantize_chunk does for it; the
// file links ggml-quants.c alone (the stubs below are never called):
//
//   gcc -O2 -c -I$LLAMA/ggml/include -I$LLAMA/ggml/src $LLAMA/ggml/src/ggml-quants.c -o quants.o
//   gcc -O2 -I$LLAMA/ggml/include -I$LLAMA/ggml/src make_golden_mxfp4.c quants.o -o mx -lm
//   ./mx gauss && ./mx student3
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include "ggml.h"
#include "ggml-quants.h"
#define GGML_COMMON_DECL_C
#include "ggml-common.h"

void ggml_abort(const char* f, int l, const char* fmt, ...) { (void)f; (void)l; (void)fmt; abort(); }
size_t ggml_row_size(enum ggml_type t, int64_t n) { (void)t; (void)n; abort(); }
const char* ggml_type_name(enum ggml_type t) { (void)t; abort(); }
size_t ggml_type_size(enum ggml_type t) { (void)t; abort(); }

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    char p[256];
    snprintf(p, sizeof p, "%s.f32", argv[1]);
    FILE* f = fopen(p, "rb");
    static float x[8192];
    if (!f || fread(x, 4, 8192, f) != 8192) return 1;
    fclose(f);
    static block_mxfp4 q[8192 / QK_MXFP4];
    quantize_row_mxfp4_ref(x, q, 8192);
    snprintf(p, sizeof p, "%s.mxfp4", argv[1]);
    f = fopen(p, "wb");
    fwrite(q, sizeof q[0], 8192 / QK_MXFP4, f);
    fclose(f);
    return 0;
}
