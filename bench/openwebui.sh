#!/usr/bin/env bash
# Open WebUI, the real client, against `smoe serve` on the demo vault, in headless Chromium.
#
#   bench/openwebui.sh [--max-tokens N]     (default 64; pass "" for none)
#
# Installs open-webui==0.12.4 from PyPI into target/openwebui-venv or $OPENWEBUI_VENV (about 7 GB, several
# minutes, once), selenium into target/pyenv, and needs Debian's chromium and chromium-driver
# (installed with apt-get when run as root). Starts smoe serve (built here, release) on a
# vault shattered from models/stdlib-moe, starts Open WebUI pointed at it as an
# OpenAI-compatible connection with authentication off and its defaults otherwise, and runs
# bench/openwebui_drive.py: the models in Open WebUI's picker, a streamed reply, a follow-up
# turn's cached prefix, and the time to first token of a first and a second new conversation
# (in the browser and as the server measured each request). Screenshot: target/openwebui.png.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
max_tokens=${1:-}
[ "$max_tokens" = --max-tokens ] && max_tokens=$2 || max_tokens=64
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
rm -rf "$work/vaults" && mkdir -p "$work/vaults"
"$smoe" shatter models/stdlib-moe -o "$work/vaults/demo.smoe" >/dev/null 2>&1

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
args=(serve --models "$work/vaults" --port 8099)
[ -n "$max_tokens" ] && args+=(--max-tokens "$max_tokens")
"$smoe" "${args[@]}" >"$work/smoe.log" 2>&1 &
pids+=($!)
# Open WebUI offline: no embedding model download, no Ollama, no login; run from $work, where it
# writes its secret key file.
(cd "$work" && DATA_DIR=$work/data WEBUI_AUTH=False ENABLE_OLLAMA_API=False OFFLINE_MODE=True HF_HUB_OFFLINE=1 \
    RAG_EMBEDDING_MODEL_AUTO_UPDATE=False OPENAI_API_BASE_URL=http://127.0.0.1:8099/v1 OPENAI_API_KEY=none \
    exec "$venv/bin/open-webui" serve --host 127.0.0.1 --port 8098 >"$work/openwebui.log" 2>&1) &
pids+=($!)
for _ in $(seq 180); do
    curl -sf -o /dev/null http://127.0.0.1:8098/ && break
    sleep 1
done
"$py" bench/openwebui_drive.py http://127.0.0.1:8098 http://127.0.0.1:8099 "$root/target/openwebui.png"
grep -h "tool schemas dropped" "$work/smoe.log" | tail -1 || true
