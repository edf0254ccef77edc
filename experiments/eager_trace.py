"""PyTorch-profiler Chrome traces of eager PyTorch training steps of zoo models, recorded as the
H100 traces in shared/traces/h100-1x1 were (its README.md), for calibration.from_trace:

`python -m experiments.eager_trace --models bert-sgmoe:paper switch-trace:paper --precision bf16
--out-dir DIR` writes DIR/bert-sgmoe-paper-bf16.json.gz and DIR/switch-trace-paper-bf16.json.gz.

Each model is `hidup.models.get_model(NAME, gpus=1)` on the device, trained with
`torch.optim.SGD(lr=0.01)` on its own random inputs (`spec.inputs(batch,
torch.Generator().manual_seed(step))`, a new batch each step): the loss under
`torch.autocast(DEVICE, torch.bfloat16)` for bf16, backward, step, `zero_grad(set_to_none=True)`,
then a sync. Profiled with `schedule(wait=1, warmup=2, active=4)` and `record_shapes=True`, CPU
and (on CUDA) CUDA activities, so each trace holds the steps `ProfilerStep#3..6`. `--device cpu`
records the host only (a check of this script without a GPU)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from hidup.models import get_model

PROG = "python -m experiments.eager_trace"
WAIT, WARMUP, ACTIVE = 1, 2, 4


def record(name: str, batch: int, precision: str, device: torch.device, path: Path) -> None:
    """Profile eager training steps of zoo model `name` into the Chrome trace `path`."""
    spec = get_model(name, gpus=1)
    torch.manual_seed(0)
    model = spec.build().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dtype = torch.bfloat16 if precision == "bf16" else None
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities, record_shapes=True,
                 schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for s in range(WAIT + WARMUP + ACTIVE):
            inputs = [x.to(device) for x in spec.inputs(batch, torch.Generator().manual_seed(s))]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            prof.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert-sgmoe:paper", "switch-trace:paper"],
                    help="zoo models NAME:SIZE to trace, one trace each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="global batch (default: %(default)s)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16",
                    help="fp32, or bf16 autocast (default: %(default)s)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="where to train; cpu records host activity only (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, required=True,
                    help="folder for the traces, MODEL-SIZE-PRECISION.json.gz each")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here; give --device cpu to check the script on the CPU")
    device = torch.device(args.device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{PROG} {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name(device)
                                             if device.type == "cuda" else "CPU"))
    for name in args.models:
        path = args.out_dir / f"{name.replace(':', '-')}-{args.precision}.json.gz"
        record(name, args.batch, args.precision, device, path)
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.2f} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
