#!/usr/bin/env bash
# Memory pressure from a cgroup-v1 memory limit lowered under a running `smoe serve` (issue #22).
# Needs root and a writable /sys/fs/cgroup/memory (cgroup v1). Not run in CI.
#
#   bench/cgroup_pressure.sh SMOE_BINARY VAULT_DIR MODEL [PORT] [STEPS_PERCENT...]
#
# Creates the memory cgroup smoe-pressure-$$, starts `smoe serve --models VAULT_DIR` inside it
# (so its page cache is charged there too), warms it with a few requests, then lowers
# memory.limit_in_bytes step by step to the given percentages of the usage measured after the
# warm-up (default 100 90 80 70 60 50 40 30 20), driving 6 chat requests with fresh prompts after
# each step. For each step it prints whether the kernel accepted the limit, the HTTP statuses,
# the cgroup's usage, its anonymous (rss) and page-cache (cache) parts, failcnt, oom_kill,
# whether the server is still alive, and the server's expert cache (what it may hold / what it
# holds, from /v1/smoe/stats: the memory watch shrinks it). Prints the server's memory-watch log
# lines, kills the server and removes the cgroup at the end. Extra `smoe serve` flags: SERVE_ARGS.
# WARM=N requests of warm-up (default 4); START_LIMIT_MIB=M sets a limit before the server starts
# (so its memory budget and expert cache are sized under it).
set -u
SMOE=${1:?smoe binary}; DIR=${2:?vault dir}; MODEL=${3:?model name}; PORT=${4:-18200}
shift $(( $# < 4 ? $# : 4 ))
STEPS=${*:-100 90 80 70 60 50 40 30 20}
CG=/sys/fs/cgroup/memory/smoe-pressure-$$
LOG=$(mktemp /tmp/smoe-pressure-XXXX.log)
mkdir "$CG" || exit 1
[ -n "${START_LIMIT_MIB:-}" ] && echo $(( START_LIMIT_MIB * 1048576 )) > "$CG/memory.limit_in_bytes" && echo "limit at start: $START_LIMIT_MIB MiB"
mib() { echo $(( $1 / 1048576 )); }
cgstat() { awk -v k="$1" '$1 == k { print $2 }' "$CG/memory.stat"; }
oomkills() { awk '$1 == "oom_kill" { print $2 }' "$CG/memory.oom_control"; }
servestat() {  # a model's figure from the server's stats, in MiB
  local v; v=$(curl -s --max-time 5 "http://127.0.0.1:$PORT/v1/smoe/stats" | grep -o "\"$1\":[0-9]*" | head -1 | cut -d: -f2)
  [ -n "$v" ] && mib "$v" || echo "-"
}
report() {
  local alive=no; kill -0 "$PID" 2>/dev/null && alive=yes
  printf '%-22s usage %5s MiB  rss %5s MiB  cache %5s MiB  failcnt %6s  oom_kill %s  alive %s  experts %s/%s MiB  statuses %s\n' \
    "$1" "$(mib "$(cat "$CG/memory.usage_in_bytes")")" "$(mib "$(cgstat total_rss)")" "$(mib "$(cgstat total_cache)")" \
    "$(cat "$CG/memory.failcnt")" "$(oomkills)" "$alive" "$(servestat expert_cache_bytes)" "$(servestat expert_cache_resident_bytes)" "$2"
}
drive() {  # N requests with fresh prompts; prints their statuses
  local out=""
  for i in $(seq "$1"); do
    local words; words=$(shuf -n 24 -r -e alpha beta gamma delta memory cache expert router token stream disk model layer | tr '\n' ' ')
    local st; st=$(curl -s -o /dev/null -w '%{http_code}' --max-time 120 "http://127.0.0.1:$PORT/v1/chat/completions" \
      -H 'Content-Type: application/json' \
      -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"$words $RANDOM\"}], \"max_tokens\": 8}")
    out="$out$st "
  done
  echo "$out"
}
cleanup() {
  kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null
  echo "server stderr (last lines, $LOG):"; tail -5 "$LOG"
  echo "memory watch:"; grep -E 'memory (watch|budget)|memory: ' "$LOG" | cut -c1-400
  grep -c panicked "$LOG" | sed 's/^/panics in the server log: /'
  rmdir "$CG" && echo "removed $CG"
}
echo "cgroup $CG; kernel $(uname -r); swap $(awk '/SwapTotal/ {print $2}' /proc/meminfo) kB"
sh -c "echo \$\$ > $CG/cgroup.procs && exec $SMOE serve --models $DIR --port $PORT ${SERVE_ARGS:-}" 2>"$LOG" &
PID=$!
trap cleanup EXIT
for _ in $(seq 600); do grep -q '^listening on' "$LOG" && break; kill -0 $PID 2>/dev/null || break; sleep 0.1; done
grep -q '^listening on' "$LOG" || { echo "server did not start"; exit 1; }
report "started" "-"
report "warm-up" "$(drive "${WARM:-4}")"
BASE=$(cat "$CG/memory.usage_in_bytes")
echo "working set after warm-up: $(mib "$BASE") MiB (VmRSS $(awk '/VmRSS/ {print $2, $3}' /proc/$PID/status))"
for p in $STEPS; do
  LIM=$(( BASE / 100 * p ))
  if err=$(echo "$LIM" 2>&1 > "$CG/memory.limit_in_bytes"); then res="accepted"; else res="refused"; fi
  echo "limit ${p}% = $(mib "$LIM") MiB: $res ${err:+($err)}; memory.limit_in_bytes now $(mib "$(cat "$CG/memory.limit_in_bytes")") MiB"
  report "  after 6 requests" "$(drive 6)"
  kill -0 "$PID" 2>/dev/null || { echo "server gone: $(dmesg 2>/dev/null | grep -i 'killed process' | tail -1)"; break; }
done
