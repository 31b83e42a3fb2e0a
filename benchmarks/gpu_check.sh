#!/usr/bin/env bash
# The prepared GPU check (one go, a few minutes on one H100/H200; not part of CI): training
# tokens/s and peak GPU memory of rtrl's step against a bare torch + peft loop (and TRL's
# GRPOTrainer when `trl` is importable) on a Qwen2-0.5B-shaped model with random weights in
# bf16, then rtrl's loop in two data-parallel processes when the machine has two GPUs.
#
#   bash benchmarks/gpu_check.sh          # from the repository root; needs torch, transformers,
#                                         # peft, safetensors, tokenizers, pydantic (pip install -e .)
# Record the printed figures in docs/benchmarks.md ("Training step on a GPU") with the date, and the
# vLLM conformance lines when vLLM is installed (below).
set -euo pipefail
cd "$(dirname "$0")/.."
variants=bare,rtrl
if python -c "import trl, datasets" 2>/dev/null; then variants=bare,rtrl,trl; fi
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
python benchmarks/train.py --shape qwen2-0.5b --device cuda --steps 8 --repeats 2 --batch 16 --variants "$variants"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python benchmarks/train.py --shape qwen2-0.5b --device cuda --steps 8 --repeats 1 --batch 16 --variants rtrl-ddp,rtrl-fsdp --nproc 2
fi
# vLLM conformance, when vLLM is installed: a tiny Qwen2 with a BPE and a tool-call template, a
# LoRA adapter of it, vLLM started with the flags docs/operations.md lists, then the checks of
# benchmarks/vllm_conformance.py (the protocol tests/support/vllm_stub.py implements). vLLM stopped after.
if python -c "import vllm" 2>/dev/null; then
  work=$(mktemp -d)
  python -m pipeline.cli model init-tiny --out "$work/base" --arch qwen2 --tokenizer bpe --hidden 256 --layers 2 --heads 4
  python - "$work" <<'PY'
import sys
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
work = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(f"{work}/base")
get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).save_pretrained(f"{work}/adapter")
PY
  port=18123
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server --model "$work/base" \
    --host 127.0.0.1 --port "$port" --enable-lora --max-loras 3 --max-lora-rank 8 \
    --logprobs-mode processed_logprobs --enable-auto-tool-choice --tool-call-parser hermes \
    --max-model-len 512 --gpu-memory-utilization 0.3 > "$work/vllm.log" 2>&1 &
  vllm_pid=$!
  trap 'kill $vllm_pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break
    kill -0 $vllm_pid 2>/dev/null || { tail -50 "$work/vllm.log"; exit 1; }
    sleep 1
  done
  python -c "import vllm; print('vLLM', vllm.__version__)"
  python benchmarks/vllm_conformance.py --url "http://127.0.0.1:$port" --adapter "$work/adapter"
  kill $vllm_pid; wait $vllm_pid 2>/dev/null || true
else
  echo "vLLM is not installed: no conformance check (python benchmarks/vllm_conformance.py --stub checks the stand-in)"
fi
