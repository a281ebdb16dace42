#!/bin/sh
# Miss-bound decode read bandwidth by queue depth against fio on the same file (docs/benchmarks.md,
# "Read bandwidth against fio"): one warm-up run, then three rounds of fio at QD1/4/8 followed
# by smoe at depth auto, 1 and 32 in rotated order, same 24 random tokens, a 16-expert cache
# (nearly every use misses), page cache dropped before each smoe run. Needs root and fio.
#   bench/store_depth.sh [VAULT]      default: target/bench/qwen3-30b-a3b-l48.smoe
set -eu
cd "$(dirname "$0")/.."
vault=${1:-target/bench/qwen3-30b-a3b-l48.smoe}
smoe=target/release/smoe
cargo build --release --bin smoe -q
ids=target/bench/store-depth-ids.txt
mkdir -p target/bench
python3 -c "import random; random.seed(5); print(','.join(str(random.randrange(151643)) for _ in range(24)))" > "$ids"
fio1() {
    fio --name=r --filename="$vault" --readonly --direct=1 --rw=randread --bs="$2" --ioengine=io_uring --iodepth="$1" \
        --runtime=12 --time_based --output-format=terse 2>/dev/null | awk -F';' -v qd="$1" '{printf "fio QD%s %.2f GB/s\n", qd, $7*1024/1e9}'
}
run() {
    sync
    echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
    /usr/bin/time -f "wall %e s" $smoe score "$vault" --ids-file "$ids" --decode --fast --cache-experts 16 --queue-depth "$1" \
        --instrument --out /tmp/smoe-store-depth.safetensors 2>&1 | grep -E "reads:|wall" | tr '\n' ' ' | sed "s/^/depth $1: /"
    echo
}
blob=$($smoe inspect "$vault" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['expert_blob_bytes'])")
run 1 > /dev/null
for order in "auto 1 32" "1 32 auto" "32 auto 1"; do
    fio1 1 "$blob"; fio1 4 "$blob"; fio1 8 "$blob"
    for q in $order; do run "$q"; done
done
