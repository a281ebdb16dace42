#!/usr/bin/env python3
"""One decode step's kernels from an Nsight Compute CSV, summed by kernel and launch shape.

On the device:

    ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        --launch-skip 6000 --launch-count 1300 \
        smoe bench VAULT --device cuda --cache resident --batch 8 --prompt-tokens 1 \
        --gen-tokens 17 --reps 1 > ncu8.csv

here: `python3 bench/ncu_step.py ncu8.csv`. A step runs from one `embed` launch to the next;
the last whole one is summed (ncu runs every kernel alone, so the sum is above the step's time
in a run: launches no longer overlap).
"""
import collections
import csv
import sys

TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
BYTES = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def main(path):
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    head, units = rows[0], rows[1]
    data = [r for r in rows[2:] if r and r[0].isdigit()]
    t_col, b_col = head.index("gpu__time_duration.sum"), head.index("dram__bytes_read.sum")
    name, block, grid = head.index("Kernel Name"), head.index("Block Size"), head.index("Grid Size")
    t_unit, b_unit = TIME[units[t_col]], BYTES[units[b_col]]

    def num(s):
        return float(s.replace(",", "")) if s else 0.0

    embeds = [i for i, r in enumerate(data) if r[name].startswith("embed")]
    if len(embeds) < 2:
        sys.exit(f"{path}: fewer than two embed launches, no whole step (embeds at {embeds})")
    a, b = embeds[-2], embeds[-1]
    by_kernel = collections.OrderedDict()
    for r in data[a:b]:
        s = by_kernel.setdefault((r[name], r[grid], r[block]), [0, 0.0, 0.0])
        s[0] += 1
        s[1] += num(r[t_col]) * t_unit
        s[2] += num(r[b_col]) * b_unit
    total = sum(v[1] for v in by_kernel.values())
    print(f"{len(data)} kernels profiled; one step: launches {a}..{b} ({b - a} kernels), {total:.1f} us summed")
    for (kernel, g, blk), (n, t, mb) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1]):
        rate = mb / t * 1e3 if t else 0.0
        print(f"{kernel:22} grid {g:14} block {blk:12} x{n:3} {t:8.1f} us {t / n:7.2f} us each {mb:8.1f} MB {rate:6.0f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1])
