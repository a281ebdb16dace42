#!/usr/bin/env bash
# Open WebUI, the real client, against `smoe serve`, in headless Chromium.
#
#   bench/openwebui.sh [--max-tokens N] [--vault PATH] [--chat-template FILE] [--checks LIST]
#
#   --max-tokens N        smoe serve's cap for requests that set none (default 64; "" for none)
#   --vault PATH          serve this vault (default: the demo, shattered from models/stdlib-moe)
#   --chat-template FILE  smoe serve --chat-template (e.g. bench/templates/qwen3-thinking.jinja)
#   --checks LIST         defaults,tool,reasoning (default: defaults); see bench/openwebui_drive.py
#
# Installs open-webui==0.12.4 from PyPI into target/openwebui-venv or $OPENWEBUI_VENV (about 7 GB, several
# minutes, once), selenium into target/pyenv, and needs Debian's chromium and chromium-driver
# (installed with apt-get when run as root). Starts smoe serve (built here, release) and Open
# WebUI pointed at it as an OpenAI-compatible connection with authentication off and its
# defaults otherwise (one exception: CHAT_RESPONSE_MAX_TOOL_CALL_ITERATIONS=1, so that the
# `tool` check's required call is not repeated after each tool result, up to 256 times), and
# runs bench/openwebui_drive.py: the models in Open WebUI's picker, a streamed reply, a
# follow-up turn's cached prefix, the time to first token of a first and a second new
# conversation (in the browser and as the server measured each request), a tool call and
# reasoning shown. Screenshots: target/openwebui*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
max_tokens=64 vault= template= checks=defaults
while [ $# -gt 0 ]; do
    case $1 in
        --max-tokens) max_tokens=$2; shift 2 ;;
        --vault) vault=$(realpath "$2"); shift 2 ;;
        --chat-template) template=$(realpath "$2"); shift 2 ;;
        --checks) checks=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
work=$root/target/openwebui
mkdir -p "$work"

if ! [ -x /usr/bin/chromium ] || ! [ -x /usr/bin/chromedriver ]; then
    [ "$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
venv=${OPENWEBUI_VENV:-$root/target/openwebui-venv}
if ! [ -x "$venv/bin/open-webui" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet open-webui==0.12.4
fi
py=$root/target/pyenv/bin/python
if ! "$py" -c "import selenium" 2>/dev/null; then
    python3 -m venv "$root/target/pyenv"
    "$root/target/pyenv/bin/pip" install --quiet selenium==4.38.0
fi

cargo build --release --quiet
smoe=$root/target/release/smoe
rm -rf "$work/vaults" "$work/data" && mkdir -p "$work/vaults"
if [ -n "$vault" ]; then
    ln -s "$vault" "$work/vaults/$(basename "$vault")"
else
    "$smoe" shatter models/stdlib-moe -o "$work/vaults/demo.smoe" >/dev/null 2>&1
fi

for port in 8098 8099; do
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
        echo "port $port is in use (a server left from an earlier run?)" >&2
        exit 1
    fi
done
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
args=(serve --models "$work/vaults" --port 8099)
[ -n "$max_tokens" ] && args+=(--max-tokens "$max_tokens")
[ -n "$template" ] && args+=(--chat-template "$template")
"$smoe" "${args[@]}" >"$work/smoe.log" 2>&1 &
pids+=($!)
# Open WebUI offline: no embedding model download, no Ollama, no login; run from $work, where it
# writes its secret key file.
(cd "$work" && DATA_DIR=$work/data WEBUI_AUTH=False CHAT_RESPONSE_MAX_TOOL_CALL_ITERATIONS=1 ENABLE_OLLAMA_API=False OFFLINE_MODE=True HF_HUB_OFFLINE=1 \
    RAG_EMBEDDING_MODEL_AUTO_UPDATE=False OPENAI_API_BASE_URL=http://127.0.0.1:8099/v1 OPENAI_API_KEY=none \
    exec "$venv/bin/open-webui" serve --host 127.0.0.1 --port 8098 >"$work/openwebui.log" 2>&1) &
pids+=($!)
for _ in $(seq 180); do
    curl -sf -o /dev/null http://127.0.0.1:8098/ && break
    sleep 1
done
"$py" bench/openwebui_drive.py http://127.0.0.1:8098 http://127.0.0.1:8099 "$root/target/openwebui.png" "$checks"
grep -h "tool schemas dropped" "$work/smoe.log" | tail -1 || true
