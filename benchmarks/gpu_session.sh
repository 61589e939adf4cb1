#!/usr/bin/env bash
# One GPU session's device work, prepared to run unattended on a machine without network
# (docs/local-server.md, "GPU benchmark"). Phases: bench | diagnostic | all (default).
#   bench:      benchmarks/gpu_engine.py on a random Qwen3.5 2B-class checkpoint, fast kernels then
#               the torch fallback (JSON lines in $OUT/gpu_engine.jsonl)
#   diagnostic: the embedded server on that checkpoint (CUDA, bf16), then the whole
#               `pytest -m diagnostic --backend tinker` against it, timed ($OUT/diagnostic.log,
#               $OUT/diagnostic.json); LINEAR_ATTENTION=torch / DECODE_MODE=static pass the server's
#               fallbacks through
# Needs the wheels of benchmarks/gpu_wheels.py in .whl/ (carried with the working tree); they go
# to /tmp/site, ahead of the image's own packages on PYTHONPATH.
set -uo pipefail
PHASE=${1:-all}
OUT=${OUT:-/tmp/gpu-session-out}
WORK=${WORK:-/tmp/gpu-bench}
PY=${PY:-python3}
BENCH_S=${BENCH_S:-360}
DIAG_S=${DIAG_S:-300}
PORT=${PORT:-8123}
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu TINY=1 SKIP_WHEELS=1: a CPU smoke test of the wiring
TINY_ARGS=(); [ -n "${TINY:-}" ] && TINY_ARGS=(--tiny)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
cd "$(dirname "$0")/.."

if [ -z "${SKIP_WHEELS:-}" ] && [ ! -d /tmp/site/transformers ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run benchmarks/gpu_wheels.py here first" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 3; }
fi
export PYTHONPATH="/tmp/site:$PWD/src"
{ "$PY" -V; nvidia-smi -L; "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)'
  echo "--- pip check"; "$PY" -m pip check; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ -n "${TINY:-}" ]; then CKPT="$WORK/random-qwen3_5-tiny"; else CKPT="$WORK/random-qwen3_5-2b-class"; fi
if [ "$PHASE" = bench ] || [ "$PHASE" = all ]; then
  rm -f "$OUT/gpu_engine.jsonl"
  timeout "$BENCH_S" "$PY" benchmarks/gpu_engine.py "${TINY_ARGS[@]}" --device "$DEVICE" --workdir "$WORK" \
      --out "$OUT/gpu_engine.jsonl" 2>"$OUT/gpu_engine.stderr"
  echo "gpu_engine.py exit $?"
fi

if [ "$PHASE" = diagnostic ] || [ "$PHASE" = all ]; then
  [ -f "$CKPT/config.json" ] || timeout 180 "$PY" benchmarks/gpu_engine.py "${TINY_ARGS[@]}" --device "$DEVICE" \
      --workdir "$WORK" --build-only --out "$WORK/checkpoint.jsonl" 2>>"$OUT/gpu_engine.stderr"
  rm -f "$WORK/server.stdout"
  "$PY" -m dppo_harness.local_server --host 127.0.0.1 --port "$PORT" --model-path "$CKPT" --device "$DEVICE" \
      --served-name Qwen/Qwen3.5-2B --linear-attention "${LINEAR_ATTENTION:-auto}" --decode-mode "${DECODE_MODE:-auto}" \
      --run-dir "$WORK/server-run" >"$WORK/server.stdout" 2>"$OUT/server.log" &
  SERVER=$!
  for _ in $(seq 1 180); do grep -q listening "$WORK/server.stdout" 2>/dev/null && break; sleep 1; done
  grep -q listening "$WORK/server.stdout" || { echo "server did not start"; tail -5 "$OUT/server.log"; kill "$SERVER"; exit 4; }
  grep "kernels:" "$OUT/server.log"
  T0=$(date +%s.%N)
  TINKER_BASE_URL="http://127.0.0.1:$PORT" TINKER_API_KEY=tml-local-rehearsal \
  MODAL_PROXY_TOKEN_ID=unused MODAL_PROXY_TOKEN_SECRET=unused \
    timeout "$DIAG_S" "$PY" -m pytest -m diagnostic --backend tinker --timeout=720 -p no:cacheprovider -q \
      --evidence-dir "$WORK/evidence" >"$OUT/diagnostic.log" 2>&1
  RC=$?
  T1=$(date +%s.%N)
  kill "$SERVER"; wait "$SERVER" 2>/dev/null
  "$PY" -c "import json,sys; print(json.dumps({'event': 'diagnostic', 'exit': int(sys.argv[1]), 'wall_s': float(sys.argv[3]) - float(sys.argv[2])}))" \
      "$RC" "$T0" "$T1" | tee "$OUT/diagnostic.json"
  cp "$WORK/server-run/server_stats.json" "$OUT/" 2>/dev/null || true
fi
