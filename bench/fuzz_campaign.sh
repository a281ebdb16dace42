#!/usr/bin/env bash
# A libFuzzer campaign over several targets at once (issue #22, docs/fuzzing.md): each target
# runs in fork mode on its share of the cores for the same wall time, seeded from
# `SMOE_FUZZ_SEEDS=SEEDS cargo test --release -p smoe-fuzzing -- write_seeds` and growing
# CORPUS/<target>. Built with `cargo +nightly fuzz build -O` (ASan); the binaries are taken
# from BIN/<target>.
#
#   bench/fuzz_campaign.sh BIN SEEDS CORPUS OUT SECONDS target:workers [target:workers ...]
#
# Writes OUT/<target>.log (libFuzzer's own output) and OUT/<target>-crash-* for anything it
# found, then prints one line per target: executions, exec/s, coverage, crashes, OOMs and
# timeouts. Limits on every input: no allocation above 512 MiB (-malloc_limit_mb), no more
# than 2 GiB resident (-rss_limit_mb), no input running over 10 s (-timeout).
set -u
bin=$1 seeds=$2 corpus=$3 out=$4 seconds=$5
shift 5
mkdir -p "$out" "$corpus"
pids=()
for spec in "$@"; do
    t=${spec%%:*} w=${spec##*:}
    mkdir -p "$corpus/$t"
    # Fork mode keeps going after a crash, OOM or timeout (each one is kept as an artifact) so
    # one finding does not end a target's share of the run.
    "$bin/$t" -fork="$w" -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
        -max_total_time="$seconds" -malloc_limit_mb=512 -rss_limit_mb=2048 -timeout=10 \
        -artifact_prefix="$out/$t-" "$corpus/$t" "$seeds/$t" >"$out/$t.log" 2>&1 &
    pids+=($!)
done
wait "${pids[@]}"
for spec in "$@"; do
    t=${spec%%:*}
    # Fork mode's status lines: "#EXECS: cov: C ft: F corp: N exec/s: E oom/timeout/crash: O/T/C time: S".
    last=$(grep -E '^#[0-9]+: cov:' "$out/$t.log" | tail -1)
    found=$(find "$out" -maxdepth 1 -name "$t-*" -type f | wc -l)
    echo "$t ${spec##*:} workers | $last | artifacts $found"
done
