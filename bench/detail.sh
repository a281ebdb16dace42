#!/bin/sh
# Detail measurements behind docs/benchmarks.md, on the harness's vault (run bench/run first):
# kernel throughput per core, f16 vs f32 KV attention, the per-phase profile of cached prefill
# and decode, and the expert store under a small cache (read bandwidth by queue depth,
# checksums on/off, lookahead prefetch on/off). Prints everything; takes ~15 min at 48 layers.
#   bench/detail.sh [VAULT] [CACHE]      defaults: target/bench/qwen3-30b-a3b-l48.smoe 2GiB
set -eu
cd "$(dirname "$0")/.."
vault=${1:-target/bench/qwen3-30b-a3b-l48.smoe}
cache=${2:-2GiB}
smoe=target/release/smoe
cargo build --release --bin smoe -q
cargo build --release -p smoe-kernels --examples -q
ids=target/bench/detail-ids.txt
# 64 random token ids below the Qwen2 vocabulary's 151643 regular tokens (fixed seed).
python3 -c "import random; random.seed(5); print(','.join(str(random.randrange(151643)) for _ in range(64)))" > "$ids"

echo "== kernels: one row x one token, GB/s of weights per core"
target/release/examples/kspeed
echo "== kernels: one row / four rows x 32 tokens (prefill), GMAC/s per core"
target/release/examples/gspeed
echo "== decode attention over f32 vs f16 KV, one layer, 8,192 positions"
for kv in f32 f16; do
    SMOE_ATTN_KV=$kv SMOE_ATTN_POSITIONS=8192 cargo test --release -q -p smoe-engine --lib -- --ignored --nocapture --exact \
        cpu::attention::speed::attention_speed
done

echo "== profile: prefill of 512 tokens, cached"
$smoe bench "$vault" --cache resident --prompt-tokens 512 --gen-tokens 1 --instrument
echo "== profile: decode of 128 tokens from an empty context, cached"
$smoe bench "$vault" --cache resident --prompt-tokens 1 --gen-tokens 128 --instrument

store() {
    echo "== store: $*"
    sync
    echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
    $smoe score "$vault" --ids-file "$ids" --decode --fast --cache "$cache" --instrument --out /tmp/smoe-detail.safetensors "$@" 2>&1 |
        grep -E "expert cache|scored|per token|experts:|reads:|prefetch"
}
for qd in auto 32 8 1; do store --queue-depth $qd; done
store --no-verify
store
store --prefetch lookahead
store --prefetch off
