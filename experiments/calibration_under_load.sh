#!/usr/bin/env bash
# The calibration test under load, in the repository's root:
#   bash experiments/calibration_under_load.sh [RUNS]
# runs tests/test_calibration_profile.py::test_two_gloo_ranks_under_torchrun_write_a_profile
# RUNS times in a row (default 20) while another process keeps both cores busy (a 2-thread loop
# of 1024x1024 matmuls), and prints each run's result and how many passed. Run it alone.
set -uo pipefail
runs=${1:-20}
python -c "
import torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
while True:
    a = (a @ a).tanh_()
" &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
passed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  if log=$(python -m pytest -q -p no:cacheprovider \
      "tests/test_calibration_profile.py::test_two_gloo_ranks_under_torchrun_write_a_profile" 2>&1); then
    passed=$((passed + 1))
    echo "run $i: passed in $(($(date +%s) - start)) s"
  else
    echo "run $i: FAILED in $(($(date +%s) - start)) s"
    echo "$log" | tail -30
  fi
done
echo "$passed of $runs passed"
[ "$passed" -eq "$runs" ]
