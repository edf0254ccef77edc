"""The model zoo, selected by name with a size preset: 'NAME' or 'NAME:SIZE' (e.g. 'bert-sgmoe:tiny').
`tiny` is for tests and CPU runs, `paper` the paper's sizes. Mixture-of-experts models depend on
the number of GPUs (experts = 2 x GPUs, 4 x for switch-trace), so a spec is made for a world size."""
from __future__ import annotations

import functools
import hashlib
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hidup.graph.cache import cache_folder, code_digest, write_entry
from hidup.graph.capture import CaptureError, Graph, capture
from hidup.models import basic, bert, llama, switch_trace, vit
from hidup.models.moe import capacity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # 'bert-sgmoe:tiny'
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, torch.Generator], tuple]  # global batch size, generator -> inputs
    batch: int  # default global batch size
    task: str  # 'mlm' | 'lm' | 'image' | 'regression' | 'sum': what data it trains on
    seq: int = 0  # sequence length of text models
    vocab: int = 0
    key: str = ""  # what made it (name, GPUs, vocabulary, overrides): names its cached capture
    # what of the model grows with the GPUs it is made for, in words ('' where nothing does):
    # more GPUs make a larger model, not a smaller share of this one
    grows: str = ""


BERT = {"tiny": dict(vocab=64, dim=32, heads=4, hidden=64, layers=2, seq=16, per_gpu=2,
                     dropout=0.0),
        "small": dict(vocab=2048, dim=128, heads=4, hidden=512, layers=2, seq=32, per_gpu=8,
                      dropout=0.0),
        "paper": dict(vocab=30522, dim=768, heads=12, hidden=3072, layers=8, seq=128, per_gpu=32,
                      dropout=0.1)}
VIT = {"tiny": dict(image=8, patch=2, dim=32, heads=4, hidden=64, layers=2, per_gpu=2, dropout=0.0),
       "paper": dict(image=32, patch=4, dim=768, heads=12, hidden=3072, layers=8, per_gpu=32,
                     dropout=0.1)}
TRACE = {"tiny": dict(dim=32, heads=4, hidden=64, layers=2, seq=16, per_gpu=2, dropout=0.0),
         "paper": dict(dim=1024, heads=4, hidden=4096, layers=6, seq=256, per_gpu=32, dropout=0.1)}
GPT = {"tiny": dict(vocab=64, dim=32, heads=4, layers=2, seq=16, batch=8),
       "small": dict(vocab=4096, dim=256, heads=8, layers=4, seq=64, batch=16),
       "paper": dict(vocab=50257, dim=768, heads=12, layers=12, seq=1024, batch=8)}
# Llama 3.1 8B's sizes (8b), local batch per_gpu sequences of seq tokens per GPU
LLAMA = {"tiny": dict(vocab=64, dim=32, heads=4, kv_heads=2, hidden=64, layers=2, seq=16,
                      per_gpu=4),
         "8b": dict(vocab=128256, dim=4096, heads=32, kv_heads=8, hidden=14336, layers=32,
                    seq=8192, per_gpu=2)}
MLP = {"tiny": dict(dim=16, hidden=64, layers=2, batch=8),
       "small": dict(dim=512, hidden=2048, layers=4, batch=64)}
AUX_WEIGHT = 0.0  # the load-balancing loss needs whole-batch statistics: off for Duplex


def _bert(c, experts, top_k, vocab):
    c = dict(c, vocab=vocab or c["vocab"])
    cap = capacity(c["seq"], experts, top_k)
    build = lambda: bert.BertMoE(c["vocab"], c["dim"], c["heads"], c["hidden"], c["layers"],  # noqa: E731
                                 c["seq"], experts, top_k, cap, c["dropout"], AUX_WEIGHT)
    return build, bert.random_inputs(c["vocab"], c["seq"]), "mlm", c


def _vit(c, experts, top_k, vocab):
    seq = (c["image"] // c["patch"]) ** 2 + 1
    cap = capacity(seq, experts, top_k)
    build = lambda: vit.VitMoE(c["image"], c["patch"], 3, 10, c["dim"], c["heads"], c["hidden"],  # noqa: E731
                               c["layers"], experts, top_k, cap, c["dropout"], AUX_WEIGHT)
    return build, vit.random_inputs(c["image"], 3, 10), "image", {}


def _trace(c, experts, top_k, vocab):
    build = lambda: switch_trace.SwitchTrace(c["dim"], c["heads"], c["hidden"], c["layers"],  # noqa: E731
                                             c["seq"], experts, c["dropout"])
    return build, switch_trace.random_inputs(c["seq"], c["dim"]), "sum", {}


def _gpt(c, experts, top_k, vocab):
    c = dict(c, vocab=vocab or c["vocab"])
    build = lambda: basic.TransformerLM(c["vocab"], c["dim"], c["heads"], c["layers"], c["seq"])  # noqa: E731
    return build, basic.lm_inputs(c["vocab"], c["seq"]), "lm", c


def _llama(c, experts, top_k, vocab):
    c = dict(c, vocab=vocab or c["vocab"])
    build = lambda: llama.Llama(c["vocab"], c["dim"], c["heads"], c["kv_heads"], c["hidden"],  # noqa: E731
                                c["layers"], c["seq"])
    return build, basic.lm_inputs(c["vocab"], c["seq"]), "lm", c


def _mlp(c, experts, top_k, vocab):
    build = lambda: basic.MLP(c["dim"], c["hidden"], c["layers"])  # noqa: E731
    return build, basic.regression_inputs(c["dim"]), "regression", {}


# name -> (builder, sizes, experts a token picks (0: dense), experts per GPU (0: dense)); a size
# with `per_gpu` has a global batch of that many per GPU, one with `batch` that batch
_ZOO = {"bert-sgmoe": (_bert, BERT, 2, 2), "bert-switch": (_bert, BERT, 1, 2),
        "vit-sgmoe": (_vit, VIT, 2, 2), "vit-switch": (_vit, VIT, 1, 2),
        "switch-trace": (_trace, TRACE, 1, 4), "gpt": (_gpt, GPT, 0, 0),
        "llama": (_llama, LLAMA, 0, 0), "mlp": (_mlp, MLP, 0, 0)}


def names() -> list[str]:
    return [f"{n}:{s}" for n, (_, sizes, *_) in _ZOO.items() for s in sizes]


def get_model(spec: str, gpus: int = 1, vocab: int | None = None, **overrides) -> ModelSpec:
    """The model NAME:SIZE made for `gpus` GPUs (text models may take the vocabulary size of data);
    `overrides` change the size preset's figures, e.g. layers=24."""
    name, _, size = spec.partition(":")
    if name not in _ZOO:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_ZOO)} (with a size, "
                         f"e.g. {names()[0]})")
    make, sizes, top_k, per_gpu_experts = _ZOO[name]
    size = size or "tiny"
    if size not in sizes:
        raise ValueError(f"model {name} has no size {size!r}; choose one of {sorted(sizes)}")
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    unknown = sorted(set(overrides) - set(sizes[size]))
    if unknown:
        raise ValueError(f"model {name} has no setting {unknown}; its settings are "
                         f"{sorted(sizes[size])}")
    c = dict(sizes[size], **overrides)
    build, inputs, task, cfg = make(c, per_gpu_experts * gpus, top_k, vocab)
    batch = c["per_gpu"] * gpus if "per_gpu" in c else c["batch"]
    key = f"{name}:{size} gpus={gpus} vocab={vocab} overrides={sorted(overrides.items())}"
    grows = f"its experts ({per_gpu_experts} per GPU)" if per_gpu_experts else ""
    return ModelSpec(f"{name}:{size}", build, inputs, batch, task, cfg.get("seq", 0),
                     cfg.get("vocab", 0), key, grows)


def capture_model(spec: ModelSpec, batch: int) -> Graph:
    """The zoo model's graph at `batch`: from the capture cache where this model, batch, torch
    and HiDup's capture code were captured before (torch.export takes seconds), else captured
    and cached. HIDUP_CACHE names the cache folder (default ~/.cache/hidup; 'off': none)."""
    path = _cache_path(spec, batch)
    if path is not None and path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception as exc:  # a cache written by another version, or cut short: capture
            log.info("capture cache %s unreadable (%s); capturing again", path, exc)
    graph = _capture(spec, batch)
    if path is not None and not write_entry(path, lambda f: _GraphPickler(f).dump(graph)):
        log.info("cannot cache the capture in %s", path)
    return graph


def _cache_path(spec: ModelSpec, batch: int) -> Path | None:
    folder = cache_folder("graphs")
    if folder is None or not spec.key:
        return None
    digest = hashlib.sha256(f"{spec.key} batch={batch} code={_capture_code_digest()}".encode())
    return folder / f"{spec.name.replace(':', '-')}-{digest.hexdigest()[:16]}.pkl"


@functools.cache
def _capture_code_digest() -> str:
    """A digest of the code that makes a graph (the zoo, capture, FLOPs) and of torch's
    version, read once a process."""
    here, graph = Path(__file__).parent, Path(__file__).parent.parent / "graph"
    return code_digest([*here.glob("*.py"), graph / "capture.py", graph / "flops.py"])


class _GraphPickler(pickle.Pickler):
    """Pickles a Graph: an ATen op by its name (an OpOverload does not pickle itself)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _aten_op, (obj.name(),)
        return NotImplemented


def _aten_op(name: str):
    """The OpOverload named e.g. 'aten::linear' or 'aten::sum.dim_IntList'."""
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def _capture(spec: ModelSpec, batch: int) -> Graph:
    """Capture on the meta device (no weights allocated); on the CPU if an op needs real data."""
    inputs = spec.inputs(batch, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    try:
        with torch.device("meta"):
            module = spec.build()
        return capture(module, tuple(x.to("meta") for x in inputs))
    except CaptureError as exc:
        log.info("capture on the meta device failed (%s); capturing on the CPU", exc)
    torch.manual_seed(0)
    return capture(spec.build(), inputs)
