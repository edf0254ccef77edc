#!/usr/bin/env bash
# The GPU table's runs, on one CUDA machine, in the repository's root:
#   bash experiments/gpu_table.sh OUT [PART ...]
# OUT: a folder for the log and the JSON rows; PARTS: some of smoke sync memory third-party
# third-party-compile bert-sgmoe-bf16 llama-memory others-bf16 bert-sgmoe-fp32 bert-sgmoe-b128-bf16 (default: all,
# in that order, the first ones fit about 7 minutes of an H100's lease). Each part has its own time
# limit and the parts after a failed one still run, except that nothing runs when the smallest
# CUDA step (smoke) fails. Needs torch with CUDA, pytest and `transformers` (for the third-party
# checks and the memory cases).
# Not in the default list: h200-calibration, about 330 s on an H200 (the total it lets its four
# commands run; CALIBRATION_S=SECONDS changes it): eager bf16 traces of bert-sgmoe:paper and
# switch-trace:paper at batch 32 into OUT/traces (experiments.eager_trace, for
# calibration.from_trace), then executor rows in bf16 at each model's own batch (bert-sgmoe 32,
# gpt 8) into OUT/exec-bf16-{bert,gpt-k1,gpt-k2}.json (experiments.gpu_accuracy fits each mode's
# host cost per task on bert-sgmoe's k=1 rows and predicts the rest out of sample).
set -u
out=${1:?give a folder for the results}
shift
parts=" ${*:-smoke sync memory third-party third-party-compile bert-sgmoe-bf16 llama-memory others-bf16 bert-sgmoe-fp32 bert-sgmoe-b128-bf16} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
part() {  # part NAME SECONDS COMMAND...: run it under a time limit, its output into the log
    local name=$1 limit=$2; shift 2
    [[ $parts == *" $name "* ]] || return 0
    echo "=== $name: $* (limit ${limit} s) $(date -u +%T)" | tee -a "$log"
    local start=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | grep -v '^\[transformers\]' | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    return "$rc"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv | tee -a "$log"
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$log"
part smoke 60 python3 -m experiments.executor_overhead --models gpt:tiny --micro-batches 1 2 \
    --modes graph cuda-graphs --rounds 2 --steps 3 --busy || exit 1
# a step waits for nothing on the host; DTensor's strategies read as the tests expect on this torch
part sync 60 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py \
    tests/test_execute.py::test_a_cuda_step_waits_for_nothing_on_the_host
# real peaks (torch.cuda.max_memory_allocated) beside the memory model's, and eager's
part memory 110 python3 -m experiments.memory_accuracy --device cuda --out "$out/memory"
bert() {  # bert PART LIMIT PRECISION BATCH
    part "$1" "$2" python3 -m experiments.executor_overhead \
        --models bert-sgmoe:paper --batch "$4" --precision "$3" --micro-batches 1 2 \
        --rounds 4 --steps 5 --busy --out "$out/bert-sgmoe-paper-b$4-$3.json"
}
part third-party 170 python3 -m experiments.gpu_checks --models gpt2,llama,bert,mixtral,vit,resnet,bart,t5 \
    --cases fp32:graph:2 bf16:cuda-graphs:2
part third-party-compile 90 python3 -m experiments.gpu_checks --models gpt2,llama,mixtral \
    --cases bf16:compile:2
bert bert-sgmoe-bf16 110 bf16 32
# the Llama 3.1 8B memory prediction with what autograd keeps probed on CUDA (its kernels and
# autocast policy) instead of the CPU's
part llama-memory 60 python3 -m experiments.llama_table --gpus --out "$out/llama"
part others-bf16 300 python3 -m experiments.executor_overhead --models gpt:paper switch-trace:paper \
    --precision bf16 --micro-batches 1 2 --rounds 5 --steps 5 --busy \
    --out "$out/gpt-switch-paper-bf16.json"
bert bert-sgmoe-fp32 200 fp32 32
bert bert-sgmoe-b128-bf16 200 bf16 128
# h200-calibration: each command its own limit, so the rows of one survive another's timeout;
# gpt:paper's k=2 (never finished within a lease before) gets what is left of the total
calibration_start=$SECONDS
part h200-calibration 40 python3 -m experiments.eager_trace --models bert-sgmoe:paper \
    switch-trace:paper --batch 32 --precision bf16 --out-dir "$out/traces"
executor_bf16() {  # executor_bf16 LIMIT NAME MODEL K...: rows into $out/exec-bf16-NAME.json
    local limit=$1 name=$2 model=$3; shift 3
    part h200-calibration "$limit" python3 -m experiments.executor_overhead --models "$model" \
        --precision bf16 --micro-batches "$@" --rounds 3 --steps 5 --busy \
        --out "$out/exec-bf16-$name.json"
}
executor_bf16 150 bert bert-sgmoe:paper 1 2
executor_bf16 75 gpt-k1 gpt:paper 1
left=$(( ${CALIBRATION_S:-330} - (SECONDS - calibration_start) ))
executor_bf16 $(( left > 60 ? left : 60 )) gpt-k2 gpt:paper 2
