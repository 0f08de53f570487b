#!/usr/bin/env bash
# Every check the CPU-only CI cannot run, as one prepared command for a lent CUDA machine (docs/testing.md § GPU checks).
#
#   bash scripts/gpu_checks.sh --fetch-wheels   on a machine with pip's index (this one): fills scripts/gpu_wheels/
#                                               with the pure-Python packages the GPU image lacks (+ soundfile, cffi)
#   bash scripts/gpu_checks.sh                  on the GPU machine, with scripts/gpu_wheels/ carried along
#
# It uses that machine's own python3 and torch (PYTHON= to pick another; the image's torch is not the one we
# pin: env.txt records every version, quote them with the numbers) and installs from the carried wheels, with
# no index, only what `import` says is missing. Sized to 10 minutes: every step has its own timeout and all of
# them share a budget (GPU_CHECKS_BUDGET, 570 s), so the whole run fits one 10-minute device call; a step that
# fails or times out is recorded and the next one runs. A rerun can take only some steps:
# GPU_CHECKS_STEPS="pytest parallel" (env and wheels always run). GPU_CHECKS_COMMIT names the commit where the
# tree has no .git. Writes to $OUT (./gpu-out if unset):
#   summary.txt    one line per step: rc (124: timed out), seconds, command; recipes add wall time and metric
#   env.txt        python, torch, CUDA, cuDNN, NCCL, triton, the GPU, the carried packages, the commit
#   logs.tar.gz    each step's full log, and each recipe run's result.json and metrics.jsonl (refreshed after
#                  every step, so a run cut short still brings back what finished)
# Steps:
#   wheels         install the missing hydra-core, omegaconf, antlr4 runtime, soundfile (+cffi, pycparser)
#   pytest         pytest -m gpu: attention oracle (triton/sdpa vs float64 and SDPA math, fp32/bf16, fwd+bwd),
#                  trainer step/resume on cuda, checkpoint save/load, export of a CUDA-trained run, model=llama
#                  against the image's transformers (logits, gradients, bf16 error, greedy ids)
#   lm, llama, asr, image  the recipes end to end on cuda with their defaults (lm and model=llama compiled
#                  regional, bf16; asr only where eSpeak NG is installed, else a skip line)
#   ddp, fsdp      torchrun --nproc_per_node=1 of a smoke image run per style (a one-process run starts no
#                  process group: this checks the launcher and the config path, not NCCL)
#   parallel       scripts/one_gpu_parallel.py under torchrun: NCCL, then DDP, FSDP2 and FSDP2 with
#                  param_dtype=bf16 through core.distributed.data_parallel on the recipes' models
#   attention      bench/attention.py --device cuda --quick: Triton vs SDPA flash/efficient/cuDNN, bf16, fwd and
#                  fwd+bwd, L 1k and 4k, TFLOP/s; packed vs padded
#   compile        bench.compile --device cuda: the LM recipe's model eager vs full vs regional, bf16 autocast,
#                  cold/warm compile seconds, step ms and speed-up (--resumed off: no time for artifact reloads)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py="${PYTHON:-python3}"
wheels=scripts/gpu_wheels
# import name -> distribution, for the packages the recipes import that the GPU image was seen to lack
# (KINDS.md's package list, 2026-11); versions come from constraints.txt
missing_ok=(hydra:hydra-core omegaconf:omegaconf antlr4:antlr4-python3-runtime soundfile:soundfile
    _cffi_backend:cffi pycparser:pycparser)

pin() { grep -i "^$1==" constraints.txt | head -1; }

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # the GPU image's Python is 3.12 on x86-64; the antlr4 runtime 4.9.3 (what omegaconf 2.3 needs) has no
    # wheel on PyPI, so the pure-Python ones are built here with `pip wheel` (py3-none-any, any Python)
    set -e
    mkdir -p "$wheels"
    "$py" -m pip wheel -q --no-deps -w "$wheels" "$(pin hydra-core)" "$(pin omegaconf)" \
        "$(pin antlr4-python3-runtime)" "$(pin pycparser)"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$wheels" "$(pin soundfile)" "$(pin cffi)"
    ls -l "$wheels"
    exit 0
fi

out="${OUT:-gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d "${TMPDIR:-/tmp}/gpu-checks.XXXXXX")
runs="$logs/runs"
summary="$out/summary.txt"
: >"$summary"
budget="${GPU_CHECKS_BUDGET:-570}"
t0=$SECONDS
unset TRITON_INTERPRET
# CUBLAS_WORKSPACE_CONFIG: cuBLAS reads it when its handle is made; the deterministic resume test needs it
export PYTHONPATH="$repo" PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export TORCHKILN_CACHE="$logs/cache"

record() { printf '%-10s %-7s %5ss  %s\n' "$1" "$2" "$3" "$4" >>"$summary"; }

pack() {  # the logs and the runs' small outputs (no checkpoints, no cache) into one file under $OUT
    (cd "$logs" && find . -path ./cache -prune -o \( -name '*.log' -o -name result.json -o -name metrics.jsonl \
        -o -name '*.txt' \) -type f -print | tar czf "$out/logs.tar.gz" -T -)
}

selected() { [[ $1 == wheels || -z "${GPU_CHECKS_STEPS:-}" || " $GPU_CHECKS_STEPS " == *" $1 "* ]]; }

step() {  # step NAME SECONDS CMD...: run under a timeout (clamped to the budget left), log, record its rc
    local name=$1 limit=$2 left start rc
    shift 2
    selected "$name" || return 0
    left=$((budget - (SECONDS - t0)))
    if ((left < 15)); then
        record "$name" skipped 0 "no time left of the ${budget}s budget: $*"
        return
    fi
    ((limit > left)) && limit=$left
    start=$SECONDS
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    record "$name" "rc=$rc" $((SECONDS - start)) "$*"
    pack
}

headline() {  # headline NAME: the recipe run's wall time and its monitored metric, from its result.json
    [[ -f "$logs/$1.log" ]] || return 0  # the step did not run (not selected, or no time left)
    "$py" - "$runs/$1" >>"$summary" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
try:
    r = json.loads((Path(sys.argv[1]) / "result.json").read_text())
except OSError:
    print("           -> no result.json (the run failed or timed out; see its log)")
else:
    key = r["monitor"]["key"]
    shown = ", ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items() if k.startswith("val/"))
    print(f"           -> wall {r['wall_s']:.1f}s, {key}={r['metrics'].get(key, float('nan')):.4g} ({shown})")
EOF
}

# environment: versions and the GPU, first, so a later failure can be read against them
"$py" - "$(git rev-parse HEAD 2>/dev/null || echo "${GPU_CHECKS_COMMIT:-unknown}")" >"$out/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("commit", sys.argv[1])
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    print("nccl", torch.cuda.nccl.version())
else:
    print("gpu NONE: torch sees no CUDA device")
for name in ("triton", "torchvision", "torchaudio", "numpy", "tokenizers", "safetensors", "tensorboard",
             "scikit-learn", "pytest", "onnxruntime", "hydra-core", "omegaconf", "antlr4-python3-runtime",
             "soundfile", "cffi", "espeakng-loader"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
record env "rc=$?" $((SECONDS - t0)) "versions -> env.txt"
cat "$out/env.txt"

# wheels: only what is missing, from the carried folder, no index
need=()
for pair in "${missing_ok[@]}"; do
    mod=${pair%%:*} dist=${pair#*:}
    "$py" -c "import $mod" 2>/dev/null && continue
    file=$(ls "$wheels"/"${dist//-/_}"-*.whl 2>/dev/null | head -1)
    if [[ -z "$file" ]]; then
        record wheels missing 0 "$dist is not installed and $wheels has no wheel: run --fetch-wheels first"
    else
        need+=("$file")
    fi
done
if ((${#need[@]})); then
    # into python3's own environment (a lent machine is bare and given back): the tests' and benches'
    # subprocesses set PYTHONPATH themselves, so a --target folder on PYTHONPATH would not reach them
    step wheels 60 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${need[@]}"
else
    record wheels ok 0 "nothing missing"
fi

# the gpu-marked tests, from the files that hold them (collecting every file would import optional stacks)
mapfile -t gpu_files < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
step pytest 150 "$py" -m pytest -q -rfEs -p no:cacheprovider -m gpu "${gpu_files[@]}"

# the recipes end to end on cuda, defaults otherwise
train=("$py" -m recipes.train device=cuda logger=none trainer.progress=false)
step lm 75 "${train[@]}" +task=lm precision=bf16 compile.policy=regional "hydra.run.dir=$runs/lm"
headline lm
# the Llama-style decoder (model=llama's debug preset): GQA, RoPE, SwiGLU through the same stages
step llama 60 "${train[@]}" +task=lm model=llama precision=bf16 compile.policy=regional "hydra.run.dir=$runs/llama"
headline llama
if "$py" -c 'import espeakng_loader' 2>/dev/null || command -v espeak-ng >/dev/null; then
    step asr 60 "${train[@]}" experiment=asr_conformer "hydra.run.dir=$runs/asr"
    headline asr
elif selected asr; then
    record asr skipped 0 "no eSpeak NG (espeakng-loader or espeak-ng) to synthesise the default corpus"
fi
step image 45 "${train[@]}" +task=image_classification "hydra.run.dir=$runs/image"
headline image

# torchrun with one process per style, then the collectives and wrappers on a one-rank NCCL group
torchrun=("$py" -m torch.distributed.run --standalone --nproc_per_node=1)
for style in ddp fsdp; do
    step "$style" 35 "${torchrun[@]}" -m recipes.train device=cuda logger=none +task=image_classification \
        trainer=smoke "trainer.parallel=$style" "hydra.run.dir=$runs/$style"
    headline "$style"
done
step parallel 45 "${torchrun[@]}" scripts/one_gpu_parallel.py
selected parallel && grep -E '^(nccl|gloo|small_cnn|gpt) ' "$logs/parallel.log" 2>/dev/null | sed 's/^/           -> /' >>"$summary"

# the benchmarks (tables in their logs)
step attention 75 "$py" bench/attention.py --device cuda --quick
step compile 100 "$py" -m bench.compile --device cuda --models lm_gpt --policies eager,full,regional \
    --autocast bf16 --resumed off --steps 20

pack
# the benchmarks' headline rows, the tails of what failed, then the summary last (a device call returns the
# end of the output)
echo "---- attention: Triton vs the best SDPA backend"
grep -E '^B=|ratio vs best' "$logs/attention.log" 2>/dev/null
echo "---- compile"
tail -n 8 "$logs/compile.log" 2>/dev/null
while read -r name rc _; do
    if [[ "$rc" == rc=* && "$rc" != rc=0 && -f "$logs/$name.log" ]]; then
        echo "---- $name ($rc), last lines:"
        tail -n 15 "$logs/$name.log"
    fi
done <"$summary"
rm -rf "$logs"
echo "==== summary ($((SECONDS - t0))s of ${budget}s; logs in $out/logs.tar.gz)"
cat "$summary"
