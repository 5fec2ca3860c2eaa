#!/usr/bin/env bash
# One-GPU check of the trainer, in under 10 minutes: the GPU tests (flex-attention backward vs
# SDPA for both draft architectures, the deepseek_v4 draft's bf16 steps, bf16-mixed fit, FSDP on
# one GPU, device-side fp8 capture copies), then the draft-step and
# loader benchmarks on the GPU. Needs python3 with torch (CUDA), lightning, transformers, pyarrow,
# fsspec, safetensors, pytest. The project's other small dependencies (zarr, numcodecs,
# crc32c, jsonargparse and theirs) are installed from wheels in .whl/ when that folder exists.
# Where vLLM is installed it also serves a trained DFlash2 draft (benchmarks/serve_dflash2.py:
# lossless greedy outputs, acceptance length beside sparkforge eval's; on CPU, the dry run checks
# that vLLM refuses it); that step has not run on a GPU yet.
# With vLLM (GPU build) importable, it then runs the served DSpark check (about 5 more minutes):
# a DSpark draft of the shipped code target, served by vLLM's V2 model runner through
# `sparkforge eval --engine vllm`, must agree with the reference decoder exactly at T=0 (rounds,
# accepted tokens, outputs) and within the intervals at T=1; it also prints the speedup at
# 1, 8 and 64 requests in flight. Not yet run on a GPU (written without one).
#
#   benchmarks/gpu_check.sh --fetch-wheels   # on a machine with PyPI: Python 3.12 wheels -> .whl/
#   benchmarks/gpu_check.sh                  # on the GPU machine, from the repository root
#   benchmarks/gpu_check.sh --dry-run        # anywhere: same steps on CPU with tiny sizes
#
# Output goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac

# Pinned to the versions the CPU suite runs with; Python 3.12 manylinux wheels.
WHEELS="zarr==3.1.6 donfig==0.8.1.post1 google-crc32c==1.9.0 numcodecs==0.16.6
crc32c==2.9.post0 jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0"

if [ "$MODE" = fetch ]; then
  mkdir -p .whl
  exclude=$(git rev-parse --git-path info/exclude)  # keeps .whl/ out of commits
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  # shellcheck disable=SC2086
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $WHEELS
  ls -l .whl
  exit 0
fi

LOG=/dev/null
if [ -n "${OUT:-}" ]; then LOG="$OUT/gpu_check.log"; fi
exec > >(tee -a "$LOG") 2>&1

# The wheels are for the GPU machine's Python 3.12; a dry run uses the local environment as it is.
if [ "$MODE" = gpu ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/sparkforge-site .whl/*.whl
  export PYTHONPATH="/tmp/sparkforge-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The repository folders become the sparkforge.* packages without installing anything.
PKG=$(mktemp -d)
mkdir -p "$PKG/sparkforge"
for part in shared manifests producer trainer; do ln -s "$PWD/$part" "$PKG/sparkforge/$part"; done
ln -s "$PWD/shared/app" "$PKG/sparkforge/app"   # sparkforge.app: the CLI and the code target
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PY" - "$MODE" <<'PYEOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"cuda {torch.cuda.is_available()} "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
import lightning, transformers, zarr, numcodecs, crc32c, jsonargparse  # noqa: E401,F401
import sparkforge.trainer.datamodule  # noqa: F401
if sys.argv[1] == "gpu" and not torch.cuda.is_available():
    sys.exit("no CUDA device: run with --dry-run on a CPU machine")
PYEOF

step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

# The served DSpark check: code target -> HF-backend cache -> DSpark draft (GPU) -> export ->
# eval --engine vllm at T=0 and T=1, then the verdicts (exit 1 unless both agree).
served_dspark() {
  local dir sf
  dir=$(mktemp -d)
  sf=("$PY" -P -m sparkforge.app.cli)
  "$PY" -P -m sparkforge.app.code_target "$dir/target" --rows 256
  "${sf[@]}" produce --config producer/examples/code_target.yaml --data "$dir/target/chat.jsonl" \
    --output "$dir/cache" --engine.model "$dir/target" --backend hf --eval_fraction 0.25 \
    --scratch_dir "$dir/scratch" --progress false
  "${sf[@]}" train --config trainer/examples/code_target.yaml --data.uri "$dir/cache" \
    --trainer.accelerator gpu --trainer.max_steps 150 --trainer.default_root_dir "$dir/train" \
    --trainer.logger.init_args.save_dir "$dir/train"
  "${sf[@]}" export "$(find "$dir/train" -name last.ckpt | head -1)" "$dir/draft" --engine vllm
  for t in 0 1; do
    "${sf[@]}" eval --draft "$dir/draft" --target "$dir/target" --cache "$dir/cache" \
      --out_dir "$dir/eval_t$t" --num_prompts 32 --max_new_tokens 64 --temperature "$t" \
      --engine vllm --served.dtype float32 --served.max_model_len 1024 \
      --served.concurrency '[1, 8, 64]' \
      --served.extra_args '["--gpu-memory-utilization", "0.3"]'
  done
  "$PY" - "$dir" <<'PYEOF'
import json, sys
verdicts = []
for t in (0, 1):
    check = json.load(open(f"{sys.argv[1]}/eval_t{t}/eval_report.json"))[
        "reconciliation"]["served_vs_reference"]
    print(f"T={t}: served vs reference {json.dumps(check)}")
    verdicts.append(check.get("agree") is True)
sys.exit(0 if all(verdicts) else 1)
PYEOF
}
START=$SECONDS
if [ "$MODE" = gpu ]; then
  step "GPU tests"
  # -o addopts= drops the CPU default "-m 'not gpu'"; every GPU test has a 300 s limit.
  timeout 420 "$PY" -P -m pytest -o addopts= -p no:cacheprovider -m gpu -q -rA \
    --timeout 300 tests/gpu || echo "GPU TESTS FAILED (exit $?)"
  step "draft step: sdpa vs flex, bf16 autocast"
  timeout 120 "$PY" -P benchmarks/bench_draft.py --device cuda --attn sdpa --seq-len 2048 \
    --steps 5 --mem-cases || echo "bench_draft sdpa FAILED"
  timeout 120 "$PY" -P benchmarks/bench_draft.py --device cuda --attn flex --seq-len 2048 \
    --steps 5 --mem-cases || echo "bench_draft flex FAILED"
  step "loader vs raw reads vs draft step on the GPU"
  timeout 240 "$PY" -P benchmarks/bench_trainer_data.py --samples 160 --hidden 1024 \
    --batch_size 8 --steps 10 --device cuda || echo "bench_trainer_data FAILED"
  step "fp8 quantisation: numpy vs torch CPU vs torch GPU"
  timeout 120 "$PY" -P benchmarks/bench_writer.py --max_cores 2 --tokens 8192 \
    || echo "bench_writer FAILED"
  step "vLLM serves a DFlash2 draft (V2 runner): lossless, acceptance vs sparkforge eval"
  if "$PY" -c "import vllm" 2> /dev/null; then
    timeout 480 "$PY" -P benchmarks/serve_dflash2.py --out_dir "$(mktemp -d)" \
      || echo "serve_dflash2 FAILED"
  else
    echo "SKIPPED: vLLM is not installed here"
  fi
  step "served DSpark: vLLM's V2 runner against the reference decoder"
  if "$PY" -c "import vllm" 2>/dev/null; then
    timeout 900 bash -c "$(declare -f served_dspark); PY=$PY; served_dspark" \
      || echo "served DSpark check FAILED (exit $?)"
  else
    echo "vLLM is not importable: served DSpark check skipped"
  fi
else
  step "GPU tests (collected only: no CUDA here)"
  "$PY" -P -m pytest -o addopts= -p no:cacheprovider -m gpu -q --collect-only tests/gpu
  step "draft step (CPU, tiny)"
  "$PY" -P benchmarks/bench_draft.py --device cpu --attn sdpa --seq-len 64 --steps 1 \
    --num-anchors 8 --mem-cases
  step "loader vs raw reads vs draft step (CPU, tiny)"
  "$PY" -P benchmarks/bench_trainer_data.py --samples 16 --hidden 128 --batch_size 2 \
    --steps 1 --device cpu
  step "vLLM's CPU runner refuses a DFlash2 draft (tiny)"
  if "$PY" -c "import vllm" 2> /dev/null; then
    "$PY" -P benchmarks/serve_dflash2.py --out_dir "$(mktemp -d)" --cpu --rows 48 --steps 2
  else
    echo "SKIPPED: vLLM is not installed here"
  fi
  step "served DSpark: GPU only (vLLM serves DSpark only on GPU; CPU CI serves DFlash)"
fi
echo; echo "gpu_check.sh ($MODE) done in $((SECONDS - START)) s"
