#!/bin/bash
show() { python3 -c "
import json,sys
for l in sys.stdin:
    l=l.strip()
    if not l.startswith('{'): continue
    j=json.loads(l); print('  seq', j['sequences'], 'decode %.2f'%j['decode_tok_s'], 'per-seq %.2f'%j['per_sequence_tok_s'], 'samples', ['%.2f'%x for x in j.get('decode_tok_s_samples',[])])"; }
for b in new old; do
  echo "== $b $(date +%T)"
  /tmp/s33/smoe-$b bench /work/q30.smoe --cache resident --threads 2 --prompt-tokens 16 --gen-tokens 33 --batch 1,4,16 --reps 2 --json 2>/dev/null | show
done
