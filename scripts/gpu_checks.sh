#!/usr/bin/env bash
# Every GPU check the CPU-only CI cannot run, as one prepared command for a lent CUDA machine:
#   bash scripts/gpu_checks.sh            (writes logs to $OUT, or ./gpu-out when OUT is unset)
# It uses the machine's own python3 (the device image holds torch, triton, torchvision, tokenizers), needs
# none of hydra/soundfile (the LM and transformer cases import only core, text and vision), and keeps each
# step under a timeout so that the whole run fits a 15-minute device budget with room for one rerun.
# That image's torch may not be the one we pin (it was 2.11 in 2026-11): env.txt records it; quote it with
# the numbers.
#   1. environment: torch/triton versions and the GPU (env.txt)
#   2. compile issue: compiled vs eager training step for the LM recipe's own model and the 8-block
#      transformer, cold/warm compile seconds (compile.txt); target: compiled >= 1.2x eager for the LM
#      (--resumed off: the artifacts column's extra processes would not fit the lease; on GPU those
#      artifacts are torch's own Triton bundle)
#   3. attention issue: Triton kernels vs SDPA backends, bf16, forward and forward+backward (attention.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

"$py" - <<'EOF' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE")
EOF

timeout 330 "$py" -m bench.compile --device cuda --models lm_gpt,transformer8 --policies eager,full,regional \
    --autocast bf16 --resumed off \
    --steps 20 2>&1 | tee "$out/compile.txt"
echo "bench.compile exit ${PIPESTATUS[0]}" | tee -a "$out/compile.txt"

timeout 200 "$py" bench/attention.py --device cuda 2>&1 | tee "$out/attention.txt"
echo "bench/attention.py exit ${PIPESTATUS[0]}" | tee -a "$out/attention.txt"
