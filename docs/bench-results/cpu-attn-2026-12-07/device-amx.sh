#!/bin/bash
# NOT RUN (2026-12-07 23:35-23:43): every device start was refused. Kept for the next session:
# build `cargo test --release -p smoe-engine --test batch --no-run`, strip and xz the binary into
# target/peercarry/batch.xz, tar+xz testdata/hf (the fixtures of bench/cuda_device.sh) into
# target/peercarry/testdata.tar.xz, move testdata/ and models/ aside, and carry target/peercarry.
# Run on the device from the repository root, carrying target/peercarry: the batch test binary
# (crates/engine/tests/batch.rs, exactness by kernel capability) stripped and xz'd, and the
# HF fixtures as testdata.tar.xz. Runs the int8 batch test on the best table, with AMX
# (SMOE_AMX=on) and with SMOE_ISA=avx2, on the Intel host's CPU.
B=$PWD/target/peercarry
[ -e $B/testdata.tar.xz ] && tar xJf $B/testdata.tar.xz && rm $B/testdata.tar.xz
ls $B/*.xz >/dev/null 2>&1 && unxz -T4 $B/*.xz; chmod +x $B/batch
mkdir -p /work target/tmp; [ -e /work/main ] || ln -sfn "$PWD" /work/main
lscpu | grep -E "Model name"; grep -o "avx512_vnni\|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
cd crates/engine
for v in "" "SMOE_AMX=on" "SMOE_ISA=avx2"; do
  echo "== ${v:-default}"
  env $v timeout 200 $B/batch --nocapture 2>&1 | grep -E "batched vs alone|test result|panicked" | sort | uniq -c | sort -rn | head -20
done
