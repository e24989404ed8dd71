#!/usr/bin/env bash
# ember on an NVIDIA GPU: the replay and quality benches with Qwen2.5-Coder-0.5B, in under 10 minutes.
#
#   bash bench/gpu.sh                                   # from the repository root, on the GPU machine
#   bash bench/gpu.sh --engine-arg kv_cache_dtype=fp8 --engine-arg max_model_len=4096
#   bash bench/gpu.sh --engine-arg 'speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
#   EMBER_BENCH_MODEL=/path/to/model bash bench/gpu.sh
#
# Each `--engine-arg KEY=VALUE` goes to every ember server the benches start (as `ember
# --engine-arg`), over ember's GPU defaults: CUDA graphs on (enforce_eager=false), prefix caching
# on, block_size 16, max_model_len up to 8192. Several servers run at once (the replay compares two,
# quality up to three), so this script asks each for gpu_memory_utilization=0.25 unless you pass
# your own. `--engine-arg enforce_eager=true` measures what CUDA graphs buy.
#
# Installs nothing beyond what it carries: the GPU machine's python must already have vLLM built
# for its CUDA (`pip install vllm`) or the wheels must sit in ./.whl (ember's own pure-Python
# dependencies, e.g. fetched with `pip download --no-deps -d .whl pygls lsprotocol cattrs ...`).
# The model is, in order: $EMBER_BENCH_MODEL (a folder, .gguf file or hub id); the converted
# Qwen2.5-Coder-0.5B folder under bench/.cache (made on any machine by `python bench/models.py
# qwen-coder`, then carried); else the hub id Qwen/Qwen2.5-Coder-0.5B-Instruct (needs a hub).
#
# Prints the engine ember started (its arguments, max_model_len, prompt budgets), the replay table
# (latency_ms / ttft_ms p50 and p95, decode tokens/s, engine start, for ember as built and with its
# ideas off) and the quality tables (exact match, edit similarity, syntax_ok, latency p50/p95 per
# source: single-line and function-body cases), and writes bench/results/*-gpu.json.
#
# Where it cannot run (no NVIDIA GPU, no CUDA build of torch, no vLLM) it says so on one line
# starting "bench/gpu.sh: cannot run here:" and exits with status 3, before starting anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results}
BUDGET_S=${BUDGET_S:-540}  # the whole script stays under 10 minutes
started=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - started))); }
cannot() { echo "bench/gpu.sh: cannot run here: $*" >&2; exit 3; }

ENGINE_ARGS=(--engine-arg gpu_memory_utilization=0.25)  # first: a later --engine-arg of the same key wins
while [ $# -gt 0 ]; do
    case "$1" in
        --engine-arg) [ $# -ge 2 ] || cannot "--engine-arg needs KEY=VALUE"; ENGINE_ARGS+=(--engine-arg "$2"); shift 2 ;;
        --engine-arg=*) ENGINE_ARGS+=(--engine-arg "${1#--engine-arg=}"); shift ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) cannot "unknown option $1 (only --engine-arg KEY=VALUE)" ;;
    esac
done

command -v nvidia-smi >/dev/null 2>&1 || cannot "no nvidia-smi: this machine has no NVIDIA driver (ember's CPU benches: bench/replay.py, bench/quality.py)"
nvidia-smi -L >/dev/null 2>&1 || cannot "nvidia-smi sees no GPU: $(nvidia-smi -L 2>&1 | head -1)"
command -v "$PY" >/dev/null 2>&1 || cannot "no $PY (set PYTHON=/path/to/python)"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ember-site .whl/*.whl
    export PYTHONPATH="/tmp/ember-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' || exit 3
import sys

def cannot(why: str) -> None:
    print(f"bench/gpu.sh: cannot run here: {why}", file=sys.stderr)
    sys.exit(3)

try:
    import torch
except ImportError:
    cannot("torch is not installed for this python (install vllm for this GPU: pip install vllm)")
try:
    import vllm
except ImportError as exc:
    cannot(f"vLLM does not import ({exc}): pip install vllm for this GPU, or carry wheels in ./.whl")
for name in ("pygls", "lsprotocol", "tree_sitter", "httpx"):
    try:
        __import__(name)
    except ImportError:
        cannot(f"ember's dependency {name} is missing: pip install -e . (or carry wheels in ./.whl)")
if not torch.cuda.is_available():
    cannot(f"torch {torch.__version__} sees no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides the GPU)")
print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, vllm {vllm.__version__}")
EOF

MODEL=${EMBER_BENCH_MODEL:-}
if [ -z "$MODEL" ]; then
    MODEL=$(dirname "$(ls -d bench/.cache/qwen-coder/models/*/.complete 2>/dev/null | head -1)" 2>/dev/null || true)
    [ "$MODEL" = "." ] && MODEL=""
fi
if [ -z "$MODEL" ]; then
    MODEL=Qwen/Qwen2.5-Coder-0.5B-Instruct
fi
echo "model: $MODEL; engine args: ${ENGINE_ARGS[*]}; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(date -u +%FT%TZ)"

# Single-line and function-body latency while typing through real files: ember vs its ideas off.
timeout $(( $(left) / 2 )) "$PY" bench/replay.py --model "$MODEL" --configs ember,off --requests 80 \
    --max-tokens 64 "${ENGINE_ARGS[@]}" --out "$RESULTS/replay-gpu.json" || echo "replay: stopped (exit $?)"

# What ember started: the engine arguments vLLM ran with, its max_model_len and the prompt budgets.
"$PY" - "$RESULTS/replay-gpu.json" <<'EOF' || true
import json, sys
run = json.load(open(sys.argv[1]))["runs"]["ember"]
engine = run["server_summary"]["engine"]
print(f"engine: start {run['load_s']:.1f} s, max_model_len {engine.get('max_model_len')}, budget {engine.get('budget')}")
print(f"engine args: {engine.get('engine_args')}")
if engine.get("warning"):
    print(f"engine warning: {engine['warning']}")
EOF

# Quality and latency per source (humaneval single-line / multi-line, SAFIM, repository body cuts).
timeout $(( $(left) - 10 )) "$PY" bench/quality.py --model "$MODEL" --limit 200 --max-tokens 128 \
    "${ENGINE_ARGS[@]}" --out "$RESULTS/quality-gpu.json" || echo "quality: stopped (exit $?)"
echo "bench/gpu.sh done in $(( $(date +%s) - started )) s"
