#!/usr/bin/env bash
# ember on an NVIDIA GPU: the replay and quality benches with Qwen2.5-Coder-0.5B, in under 10 minutes.
#
#   bash bench/gpu.sh                      # from the repository root, on the GPU machine
#   EMBER_BENCH_MODEL=/path/to/model bash bench/gpu.sh
#
# Installs nothing beyond what it carries: the GPU machine's python must already have vLLM built
# for its CUDA (`pip install vllm`) or the wheels must sit in ./.whl (ember's own pure-Python
# dependencies, e.g. fetched with `pip download --no-deps -d .whl pygls lsprotocol cattrs ...`).
# The model is, in order: $EMBER_BENCH_MODEL (a folder, .gguf file or hub id); the converted
# Qwen2.5-Coder-0.5B folder under bench/.cache (made on any machine by `python bench/models.py
# qwen-coder`, then carried); else the hub id Qwen/Qwen2.5-Coder-0.5B-Instruct (needs a hub).
#
# Prints the replay table (latency_ms / ttft_ms p50 and p95 for ember as built and with its ideas
# off) and the quality tables (exact match, edit similarity, syntax_ok, latency p50/p95 per source:
# single-line and function-body cases), and writes bench/results/*-gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results}
BUDGET_S=${BUDGET_S:-540}  # the whole script stays under 10 minutes
started=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - started))); }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ember-site .whl/*.whl
    export PYTHONPATH="/tmp/ember-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import sys
try:
    import torch, vllm, pygls, tree_sitter  # noqa: F401
except ImportError as exc:
    sys.exit(f"bench/gpu.sh: missing {exc.name}: install vllm for this GPU, or carry wheels in ./.whl")
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: torch sees no CUDA device")
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, vllm {vllm.__version__}")
EOF

MODEL=${EMBER_BENCH_MODEL:-}
if [ -z "$MODEL" ]; then
    MODEL=$(dirname "$(ls -d bench/.cache/qwen-coder/models/*/.complete 2>/dev/null | head -1)" 2>/dev/null || true)
    [ "$MODEL" = "." ] && MODEL=""
fi
if [ -z "$MODEL" ]; then
    MODEL=Qwen/Qwen2.5-Coder-0.5B-Instruct
fi
echo "model: $MODEL; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(date -u +%FT%TZ)"

# Single-line and function-body latency while typing through real files: ember vs its ideas off.
timeout $(( $(left) / 2 )) "$PY" bench/replay.py --model "$MODEL" --configs ember,off --requests 80 \
    --max-tokens 64 --out "$RESULTS/replay-gpu.json" || echo "replay: stopped (exit $?)"

# Quality and latency per source (humaneval single-line / multi-line, SAFIM, repository body cuts).
timeout $(( $(left) - 10 )) "$PY" bench/quality.py --model "$MODEL" --limit 200 --max-tokens 128 \
    --out "$RESULTS/quality-gpu.json" || echo "quality: stopped (exit $?)"
echo "bench/gpu.sh done in $(( $(date +%s) - started )) s"
