#!/usr/bin/env bash
# One lent-GPU session: environment facts, the GPU test suite, the matmul and reducer benchmarks.
# Run from the repository root on the GPU machine; results go to $OUT (default runs/gpu).
set -u
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
# tpinv.models is the top-level models/ folder mapped by setup.cfg: install in place, offline.
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== GPU tests"
python3 -m pytest tests/gpu -q -n 8 2>&1 | tail -5
if [ "$NGPU" -ge 2 ]; then
  echo "== tree reducer vs NCCL all_reduce, $NGPU GPUs"
  torchrun --nproc-per-node "$NGPU" tools/bench_reduce.py --backend nccl \
    --sizes 4K,64K,1M,4M,16M,64M,256M --iters 20 --json "$OUT/bench_reduce_nccl.json" 2>&1 | grep -v "^W1" | tail -40
fi
echo "== contract matmul vs cuBLAS"
python3 tools/bench_matmul.py --json "$OUT/bench_matmul.json" 2>&1 | tail -20
if [ "$NGPU" -ge 2 ]; then
  echo "== decoder at TP=1 vs TP=2 over NCCL"
  torchrun --nproc-per-node 2 tools/gpu_model_tp.py --models qwen3-tiny,qwen3-0.6b:24 --seq 32 \
    --json "$OUT/gpu_model_tp.json" 2>&1 | grep -v "^W1" | tail -20
fi
