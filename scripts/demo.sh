#!/usr/bin/env bash
# README's run command: serve the built-in demo model with `raypaged launch` in the background,
# wait until its gRPC health check says SERVING, stream one completion with
# `raypaged generate --server`, then stop the server (SIGTERM: a graceful shutdown).
#
#   scripts/demo.sh                          # demo model, port 50051
#   PORT=50052 PROMPT='import os' scripts/demo.sh --model /path/to/hf-model   # extra launch flags
set -euo pipefail
port=${PORT:-50051}
prompt=${PROMPT:-"def "}  # the demo model knows Python: "def " and "import " work best
log=$(mktemp -t raypaged-launch.XXXXXX)
raypaged launch --port "$port" "$@" >"$log" 2>&1 &
server=$!
stop() {
  kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true
  rm -f "$log"
}
trap stop EXIT
echo "raypaged launch (pid $server): starting; log in $log" >&2
python - "$port" "$server" "$log" <<'PY'
import os, sys, time
from raypaged.client import Client, RequestError
port, pid, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 600
with Client(f"127.0.0.1:{port}") as client:
    while True:
        try:
            if client.health(timeout=2) == "SERVING":
                break
        except RequestError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("raypaged launch exited:\n" + open(log).read())
        if time.monotonic() > deadline:
            sys.exit("raypaged launch did not become ready in 10 minutes:\n" + open(log).read())
        time.sleep(0.5)
PY
grep -m1 "raypaged ready" "$log" >&2 || true
# A mild repetition penalty: the 4M-parameter demo model loops under plain greedy decoding.
raypaged generate --server "127.0.0.1:$port" --prompt "$prompt" --max-tokens 64 --repetition-penalty 1.2
