"""hidup.graph.dtypes: each value's dtype as a bf16 run gives it (autocast's own policy, CUDA's
read on this CPU), parameters converted at their compute dtype, collectives and memory at those
dtypes, and the precision carried by profiles and plans."""
import json

import pytest

from hidup.graph.dtypes import run_dtypes
from hidup.models import capture_model, get_model
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import Plan
from hidup.planning.profile_file import ProfileError, from_dict, load_profile
from hidup.program import lower
from hidup.strategy import fixed_strategy


@pytest.fixture(scope="module")
def llama():
    spec = get_model("llama:tiny", gpus=2)
    return capture_model(spec, spec.batch)


def test_autocast_gives_each_op_its_dtype(llama):
    typed = run_dtypes(llama, "bf16", "cuda")
    by_op = {}
    for node in typed.ops:
        by_op.setdefault(node.op, set()).add(node.out.dtype)
    assert by_op["aten.linear.default"] == {"bfloat16"}  # CUDA autocast's lower-precision list
    assert by_op["aten.scaled_dot_product_attention.default"] == {"bfloat16"}
    assert by_op["aten.rsqrt.default"] == {"float32"}  # on its float32 list
    assert by_op["aten.embedding.default"] == {"float32"}  # not on a list: its weight's dtype
    linear = next(n for n in typed.ops if n.op == "aten.linear.default")
    assert typed.run.casts[linear.name] == ("bfloat16", "bfloat16")  # both inputs cast
    weights = {n.name for n in typed.params if n.out.shape and len(n.out.shape) == 2}
    assert set(typed.run.compute) == weights - {"p_tok_embeddings_weight"}
    assert all(d == "bfloat16" for d in typed.run.compute.values())
    assert all(n.out.dtype == "float32" for n in typed.params)  # master weights
    assert run_dtypes(typed, "bf16", "cuda") is typed and run_dtypes(llama, "fp32") is llama


def test_a_bf16_program_gathers_in_bf16_and_reduces_in_float32(llama):
    fsdp = fixed_strategy("fsdp", llama, 2)
    fp32, bf16 = (lower(g, fsdp, 2, 1) for g in (llama, run_dtypes(llama, "bf16", "cuda")))
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")

    def moved(program, kind, phase):
        return sum(c.bytes for c in program.collectives if c.kind == kind and c.phase == phase)
    gathered = {p.name: p.out.numel for p in llama.params}
    bf16_share = sum(gathered[t] for t in bf16.compute) / sum(gathered.values())
    # the weights every reader computes in bf16 are gathered at 2 bytes, the rest at 4
    assert moved(bf16, "all_gather", "fwd") == pytest.approx(
        moved(fp32, "all_gather", "fwd") * (1 - bf16_share / 2), rel=1e-6)
    assert moved(bf16, "reduce_scatter", "bwd") == moved(fp32, "reduce_scatter", "bwd")
    a, b = peak_memory(fp32), peak_memory(bf16)
    assert (a.params, a.optimizer) == (b.params, b.optimizer)  # float32 master weights, state
    assert b.activations_peak < a.activations_peak


def test_profiles_and_plans_carry_their_precision(llama, tmp_path):
    assert load_profile("h100-8x-ib-bf16").precision == "bf16"
    assert load_profile("cpu-gloo-loopback").device == "cpu"
    doc = load_profile("v100-2x4").to_dict()
    assert "precision" not in doc and "device" not in doc  # the defaults are left out
    with pytest.raises(ProfileError, match=r"precision must be \"fp32\" or \"bf16\""):
        from_dict({**doc, "precision": "fp16"})
    plan = Plan.of(llama, fixed_strategy("ddp", llama, 2), 2, 1, precision="bf16")
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["precision"] == "bf16"
    assert Plan.load(tmp_path / "plan.json").precision == "bf16"


def test_a_gather_bucket_holds_one_dtype(llama):
    """Weights gathered in bf16 and the norms' float32 weights go in buckets of their own (one
    flat buffer each: mixed, the float32 would promote the whole bucket)."""
    from hidup.program.tasks import Convert
    typed = run_dtypes(llama, "bf16", "cuda")
    program = lower(typed, fixed_strategy("fsdp", typed, 2), 2, 1)
    buckets = [t for t in program.tasks if isinstance(t, Convert) and t.kind == "all_gather"]
    names = [[k.split("@", 1)[0] for k in t.inputs] for t in buckets]
    assert any(all(n in typed.run.compute for n in b) for b in names)
    assert any(not any(n in typed.run.compute for n in b) for b in names)
    assert all(len({n in typed.run.compute for n in b}) == 1 for b in names)
