#!/bin/bash
# A/B of the AVX2 Q8_0 group kernels: old (62b812a) and new smoe, interleaved, 12-layer cut.
show() { python3 -c "
import json,sys
for l in sys.stdin:
    l=l.strip()
    if not l.startswith('{'): continue
    j=json.loads(l); print('  seq', j['sequences'], 'prefill %.2f'%j['prefill_tok_s'], 'decode %.2f'%j['decode_tok_s'], 'samples', ['%.2f'%x for x in j.get('decode_tok_s_samples',[])], j['backend'])"; }
for round in 1 2; do
  for b in old new; do
    echo "== $b round $round prefill512"
    /tmp/s33/smoe-$b bench /work/q12.smoe --cache resident --threads 2 --prompt-tokens 512 --gen-tokens 1 --json 2>/dev/null | show
    echo "== $b round $round decode, batches 1,4,16"
    /tmp/s33/smoe-$b bench /work/q12.smoe --cache resident --threads 2 --prompt-tokens 16 --gen-tokens 48 --batch 1,4,16 --reps 2 --json 2>/dev/null | show
  done
done
