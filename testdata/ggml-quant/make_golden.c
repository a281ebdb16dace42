// Quantizes rows with ggml's default quantizer (ggml_quantize_chunk, no imatrix) and writes
// input and output bytes, so smoe's encoders can be compared byte for byte.
#include "ggml.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <stdint.h>

static uint64_t s = 0x9e3779b97f4a7c15ull;
static double urand(void) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return ((s >> 11) + 0.5) / 9007199254740992.0; }
static double gauss(void) { return sqrt(-2 * log(urand())) * cos(6.283185307179586 * urand()); }

int main(int argc, char **argv) {
    const int rows = 16, cols = 512;
    const char *dist = argv[1];
    float *x = malloc(sizeof(float) * rows * cols);
    for (int i = 0; i < rows * cols; i++) {
        if (!strcmp(dist, "gauss")) x[i] = (float)gauss();
        else { // Student t with 3 degrees of freedom: heavy tails like real weight outliers
            double z = gauss(), c = 0; for (int k = 0; k < 3; k++) { double g = gauss(); c += g * g; }
            x[i] = (float)(z / sqrt(c / 3.0));
        }
    }
    char path[256]; snprintf(path, sizeof path, "%s.f32", dist);
    FILE *f = fopen(path, "wb"); fwrite(x, sizeof(float), rows * cols, f); fclose(f);
    enum ggml_type types[] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
                              GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        size_t rs = ggml_row_size(types[t], cols);
        void *q = malloc(rs * rows);
        ggml_quantize_chunk(types[t], x, q, 0, rows, cols, NULL);
        snprintf(path, sizeof path, "%s.%s", dist, ggml_type_name(types[t]));
        f = fopen(path, "wb"); fwrite(q, 1, rs * rows, f); fclose(f);
        // RMS error of ggml's own round trip
        float *y = malloc(sizeof(float) * rows * cols);
        ggml_get_type_traits(types[t])->to_float(q, y, rows * cols);
        double e = 0, n = 0; for (int i = 0; i < rows * cols; i++) { e += (x[i]-y[i])*(x[i]-y[i]); n += x[i]*x[i]; }
        printf("%s %s %.6f\n", dist, ggml_type_name(types[t]), sqrt(e / n));
        free(q); free(y);
    }
    return 0;
}
