#!/usr/bin/env bash
# The prepared GPU check (one go, a few minutes on one H100/H200; not part of CI): training
# tokens/s and peak GPU memory of rtrl's step against a bare torch + peft loop (and TRL's
# GRPOTrainer when `trl` is importable) on a Qwen2-0.5B-shaped model with random weights in
# bf16, then rtrl's loop in two data-parallel processes when the machine has two GPUs.
#
#   bash benchmarks/gpu_check.sh          # from the repository root; needs torch, transformers,
#                                         # peft, safetensors, tokenizers, pydantic (pip install -e .)
# Record the printed figures in docs/benchmarks.md ("Training step on a GPU") with the date.
set -euo pipefail
cd "$(dirname "$0")/.."
variants=bare,rtrl
if python -c "import trl, datasets" 2>/dev/null; then variants=bare,rtrl,trl; fi
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
python benchmarks/train.py --shape qwen2-0.5b --device cuda --steps 8 --repeats 2 --batch 16 --variants "$variants"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python benchmarks/train.py --shape qwen2-0.5b --device cuda --steps 8 --repeats 1 --batch 16 --variants rtrl-ddp,rtrl-fsdp --nproc 2
fi
