#!/usr/bin/env bash
# Every GPU check and figure of this repository, in order of importance, each step under
# its own time limit so one slow step cannot take the rest with it.
#   bash scripts/gpu_suite.sh OUT_DIR [STEP ...]
# With STEP names, only those steps run (one device call is at most 10 minutes: split the
# suite over calls, e.g. `gpu-tests gradcheck`, then `train`, then `kernels-graph tune-tma`).
# Writes logs, JSON and PNG files under OUT_DIR; the last line sums up the steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_suite.sh OUT_DIR [STEP ...]}
shift
wanted=" $* "
mkdir -p "$out"
out=$(cd "$out" && pwd)
failed=()

# Triton's autotuning choices are small JSON files in its cache directory, keyed by triton
# version, GPU target and kernel source. A fresh machine re-benchmarks every config of
# every kernel (minutes of device time); restore the choices an earlier call saved
# (.tune-cache/tune-cache.tgz, git-ignored, carried to the device) and save them again
# at the end (OUT_DIR/tune-cache.tgz).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .tune-cache/tune-cache.tgz ]; then
  tar xzf .tune-cache/tune-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored autotune choices"
fi
save_tuning() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$out/tune-cache.tgz" -T -)
}
trap save_tuning EXIT

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s)"
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    tail -n 3 "$out/$name.log"
  else
    echo "FAILED ($?): see $out/$name.log"; tail -n 5 "$out/$name.log"; failed+=("$name")
  fi
}

nvidia-smi -L
step gpu-tests 500 python -m pytest -q -m gpu -p no:cacheprovider
# the replay's tests run on the GPU when there is one (CUDA tensors, compiled kernels)
step replay-tests 200 python -m pytest -q -p no:cacheprovider tests/test_replay.py
step gradcheck 300 python scripts/gradcheck.py model=gpt2 "gradcheck.parts=[model,report]" \
  "hydra.run.dir=$out/gradcheck"
step train 550 python scripts/bench.py train --ablation --variant-timeout 200 --out "$out"
step kernels-graph 550 python scripts/bench.py kernels --graph --out "$out"
step kernels-llama 400 python scripts/bench.py kernels --graph --family swiglu rope \
  --out "$out/llama"
step train-packed 550 python scripts/bench.py train --data stdlib --variants fused \
  fused-packed eager-sdpa eager-sdpa-packed --variant-timeout 130 --out "$out/packed"
step train-llama 550 python scripts/bench.py train --model llama-124m --variants eager-sdpa \
  compile-sdpa fused fused-graph --variant-timeout 130 --out "$out/llama-124m"
step tune-tma 400 python scripts/tune_tma.py --out "$out"
step train-graphs 550 python scripts/bench.py train --compile-mode reduce-overhead \
  --variants compile-sdpa compile-fused compile-fused-traced --variant-timeout 170 \
  --out "$out/graphs"
step compile-fused 450 env TORCH_LOGS=recompiles,graph_breaks python scripts/bench.py train \
  --variants compile-sdpa compile-fused compile-fused-traced --variant-timeout 140 \
  --out "$out/compile-fused"
step scale-medium 550 python scripts/bench.py train --model gpt2-medium --batch 8 \
  --variants eager-sdpa compile-sdpa fused fused-graph --out "$out/gpt2-medium"
step scale-t4096 550 python scripts/bench.py train --seq 4096 --batch 4 \
  --variants eager-sdpa compile-sdpa fused fused-graph --out "$out/t4096"
step kernels 550 python scripts/bench.py kernels --out "$out"
step parity 550 python scripts/bench.py parity --model gpt2 --steps 300 --batch 16 \
  --seq 1024 --out "$out"
step profile 300 python scripts/bench.py profile --variant fused --host --out "$out"
step host 400 python scripts/bench.py host --out "$out/host"
step lightning-graph 500 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_cuda_graph.py
step ddp 550 python -m pytest -q -s -m gpu -p no:cacheprovider tests/test_ddp.py
echo "gpu_suite: ${#failed[@]} failed${failed:+: ${failed[*]}}"
