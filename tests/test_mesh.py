"""The 2-D mesh (named axes machines x GPUs per machine; a plan data parallel over one, its
placements over the other): the mesh's groups, the Program's, its pricing by the estimate and the
simulator, the search, plan files and hidup.planner --mesh. Its equivalence to single-device
training is in test_equivalence.py."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hidup.models import capture_model, get_model
from hidup.planner import main as plan_main
from hidup.graph.placement import R
from hidup.planning.estimate import estimate
from hidup.planning.planfile import PlanError, load_plan, save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import Search, SearchOptions
from hidup.planning.search import search
from hidup.strategy import Mesh, Strategy, fixed_strategy, mesh_option
from hidup.program import Compute, LoweringError, lower
from simulator import engine
from simulator.engine import simulate
from conftest import turned as turn

ROWS, COLUMNS = ((0, 1), (2, 3)), ((0, 2), (1, 3))
TWO = Mesh.grid(2, 2)


def test_a_mesh_numbers_its_ranks_row_major_as_device_mesh():
    mesh = Mesh.grid(2, 4)
    assert str(mesh) == "2x4 (machines, gpus)" and mesh.world == 8
    assert mesh.groups("gpus") == ((0, 1, 2, 3), (4, 5, 6, 7))  # a machine's GPUs
    assert mesh.groups("machines") == ((0, 4), (1, 5), (2, 6), (3, 7))  # one GPU of each
    assert [mesh.coords(r) for r in (0, 1, 4, 7)] == [(0, 0), (0, 1), (1, 0), (1, 3)]
    # along several axes: the ranks that differ only there; along all of them, the world
    assert mesh.groups(("machines", "gpus")) == (tuple(range(8)),) and mesh.size(mesh.names) == 8
    assert mesh.groups(()) == tuple((r,) for r in range(8)) and mesh.size(()) == 1
    cube = Mesh((2, 2, 2), ("machines", "fsdp", "tp"))
    assert cube.groups(("machines", "tp")) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert cube.group("fsdp", 5) == (5, 7) and cube.size(("fsdp", "tp")) == 4
    assert all(mesh.rank(mesh.coords(r)) == r for r in range(8))
    # a plan's rows and columns, and a rank's (part, place), data parallel over either axis
    assert mesh.rows("machines") == mesh.groups("gpus")
    assert mesh.columns("gpus") == mesh.groups("gpus")
    assert [mesh.position(r, "machines") for r in (0, 1, 4, 7)] == [(0, 0), (0, 1), (1, 0),
                                                                     (1, 3)]
    assert [mesh.position(r, "gpus") for r in (0, 1, 4, 7)] == [(0, 0), (1, 0), (0, 1), (3, 1)]
    line = Mesh.line(3)
    assert line.rows(None) == ((0, 1, 2),) and line.columns(None) == ((0,), (1,), (2,))
    assert Mesh.of_machines(1, 8) is None and Mesh.of_machines(2, 4) == mesh
    with pytest.raises(ValueError, match=r"no axis 'tp'; its axes are \['machines', 'gpus'\]"):
        mesh.groups("tp")
    with pytest.raises(ValueError, match="give one name per axis"):
        Mesh((2, 2), ("gpus",))
    with pytest.raises(ValueError, match=r"data parallel over every axis but one, not over \[\]"):
        mesh.rows(None)
    with pytest.raises(ValueError, match="data-parallel axis 'machines' of mesh 1x4 .* has one "
                                         "rank; give a mesh without it"):
        Strategy("s", {}, {}, mesh=Mesh.grid(1, 4), dp="machines")
    with pytest.raises(ValueError, match="give both, a mesh of 2 or 3 axes and its "
                                         "data-parallel axes, or neither"):
        Strategy("s", {}, {}, mesh=mesh)
    with pytest.raises(ValueError, match=r"not over \['machines', 'gpus'\]"):
        Strategy("s", {}, {}, mesh=mesh, dp=("machines", "gpus"))
    # a 3-D mesh: data parallel over two axes, split over the third
    cube = Mesh.grid(2, 2, 2)
    assert cube.names == ("machines", "outer", "gpus") and cube.outside(("machines", "outer"))
    assert cube.position(6, ("machines", "outer")) == (3, 0)  # part 1 * 2 + 1, place 0
    assert cube.position(6, ("machines", "gpus")) == (2, 1)
    assert cube.columns(("machines", "outer")) == ((0, 2, 4, 6), (1, 3, 5, 7))


def two_by_two(profile: str = "v100-8x8-10gbps"):
    """A cluster of machines of 2 GPUs: a 2 x 2 mesh spans two machines."""
    return replace(load_profile(profile), gpus_per_node=2)


def test_conversions_run_inside_machines_and_gradients_across(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("dp-megatron", graph, 4, TWO)
    program = lower(graph, strategy, 4, k=2, bucket_bytes=0)
    assert program.mesh == TWO and program.dp == ("machines",) and program.world == 4
    assert (program.parts, program.row) == (2, 2)
    fwd = [t for t in program.collectives if t.phase == "fwd" and t.tensor != graph.loss]
    assert fwd and all(t.groups == ROWS and t.group == ROWS[0] and t.axes == ("gpus",)
                       for t in fwd)
    grads = [t for t in program.collectives if t.inputs[0].startswith("d") and t.mb is None]
    kinds = {t.outputs[0].removeprefix("grad:"): t.groups for t in grads}
    assert {t.axes for t in grads} == {("machines",), ("machines", "gpus")}  # columns, world
    assert set(kinds) == {p.name for p in graph.params}  # every gradient summed across machines
    for p in graph.params:  # a Partial sum inside a machine (a consumer reads it replicated
        partial = any(  # and makes a split output) over the world; else over its column
            strategy.options[c.name].output != R and
            strategy.options[c.name].inputs[c.inputs.index(p.name)] == R
            for c in graph.consumers(p.name))
        assert kinds[p.name] == (() if partial else COLUMNS), p.name
    assert () in kinds.values() and COLUMNS in kinds.values()
    loss = [t for t in program.collectives if t.tensor == graph.loss]
    assert [t.mb for t in loss] == [0, 1] and all(t.kind == "all_reduce" for t in loss)
    # a machine's part of the batch, then its micro-batch, then the ranks' split: 8 / 2 / 2
    first = next(t for t in program.tasks if isinstance(t, Compute) and t.phase == "fwd"
                 and t.node == "embedding")
    assert first.in_shapes[1][0] == 8 // 2 // 2


def test_the_mesh_turned_around_splits_across_machines_and_sums_inside(tiny_graphs):
    """Data parallel over "gpus": the placements over one GPU of every machine, data parallel
    inside each; the estimate and the simulator see the forward's collectives cross the
    machines."""
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("dp-megatron", graph, 4, TWO)
    turned = turn(strategy)
    assert turned.mesh == TWO and turned.dp == ("gpus",)
    program = lower(graph, turned, 4, k=2, bucket_bytes=0)
    assert program.dp == ("gpus",) and program.position(1) == (1, 0)
    fwd = [t for t in program.collectives if t.phase == "fwd" and t.tensor != graph.loss]
    assert fwd and all(t.groups == COLUMNS and t.group == COLUMNS[0] and t.axes == ("machines",)
                       for t in fwd)
    grads = {t.groups for t in program.collectives
             if t.inputs[0].startswith("d") and t.mb is None}
    assert grads == {(), ROWS}  # summed over a machine's GPUs (or the world, where Partial)
    profile = two_by_two()
    assert all(profile.machines(t.group) == (0, 1) for t in fwd)  # over the inter-node link
    # the programme prices a row's collective with both rows on each machine's link
    rows = {dp: Search(graph, 4, profile, SearchOptions(k=2, mesh=TWO, dp=dp))
            for dp in ("machines", "gpus")}
    assert rows["machines"].row_load == 1 and rows["gpus"].row_load == 2
    split = profile.collective_split("all_gather", 4096, COLUMNS[0])
    assert rows["gpus"].row_time("all_gather", 4096) == pytest.approx(split[0] + 2 * split[1])
    for s in (strategy, turned):
        program = lower(graph, s, 4, k=2)
        assert estimate(program, profile).step_time == pytest.approx(
            simulate(program, profile).step_time, rel=1e-9)


def test_a_mesh_that_does_not_divide_the_world_or_batch_is_refused(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("dp-megatron", graph, 4, TWO)
    with pytest.raises(LoweringError, match=r"is for the mesh 2x2 \(machines, gpus\) of 4 GPUs, "
                                            r"not 3; plan it for 3 GPUs"):
        lower(graph, strategy, 3)
    with pytest.raises(ValueError, match="needs a mesh of the 4 GPUs of 2 or more machines"):
        fixed_strategy("dp-expert", graph, 4)
    with pytest.raises(ValueError, match="does not split into 4 micro-batches on each of 4 "
                                         "data-parallel parts"):
        lower(graph, replace(strategy, mesh=Mesh.grid(4, 1)), 4, k=4)


def test_columns_crossing_one_link_share_it_in_estimate_and_simulator(tiny_graphs, monkeypatch):
    _, _, graph = tiny_graphs["gpt:tiny"]
    profile = two_by_two()
    assert profile.link_load(COLUMNS[0], COLUMNS) == 2  # both columns cross each machine's card
    assert profile.link_load(ROWS[0], ROWS) == 1  # a machine's own ranks: no inter-node link
    for name in ("dp-megatron", "ddp"):
        for k in (1, 2):
            program = lower(graph, fixed_strategy(name, graph, 4, TWO), 4, k)
            assert estimate(program, profile).step_time == pytest.approx(
                simulate(program, profile).step_time, rel=1e-9)
    # the same step with each column alone on its link (sharing off) is faster, in both
    program = lower(graph, fixed_strategy("dp-megatron", graph, 4, TWO), 4, 1)
    shared = (estimate(program, profile).step_time, simulate(program, profile).step_time)
    monkeypatch.setattr(type(profile), "link_load", lambda self, group, parts: 1)
    monkeypatch.setattr(engine, "_crossed", lambda profile, group: (("group", group),))
    alone = (estimate(program, profile).step_time, simulate(program, profile).step_time)
    assert alone[0] < shared[0] and alone[1] < shared[1], (alone, shared)


def test_search_on_a_mesh_ranks_2d_and_1d_plans(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    found = search(graph, 4, two_by_two(), SearchOptions(k=2, mesh=TWO))
    names = [name for name, _ in found.candidates]
    assert any("-2d#" in n for n in names) and any(n.startswith("search#") for n in names)
    assert any("-2dt#" in n for n in names)  # data parallel over each machine's GPUs
    on_gpus = [r.strategy for r in found.ranked if "-2dt#" in r.name]
    assert all(s.dp == ("gpus",) and s.mesh == TWO and s.parts == 2 for s in on_gpus)
    assert all(r.strategy.mesh is None for r in found.ranked if r.name.startswith("search#"))
    times = [t for _, t in found.candidates]
    assert times == sorted(times) and found.estimate.step_time == times[0]


def test_plan_files_record_the_mesh(tiny_graphs, tmp_path):
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("dp-megatron", graph, 4, Mesh.grid(2, 2))
    path = tmp_path / "plan.json"
    save_plan(path, graph, strategy, 4, "gpt:tiny")
    doc = json.loads(path.read_text())
    assert (doc["mesh"], doc["axes"], doc["dp"]) == ([2, 2], ["machines", "gpus"], ["machines"])
    loaded = load_plan(path, graph, 4)
    assert loaded.mesh == TWO and loaded.dp == ("machines",)
    assert loaded.options == strategy.options
    save_plan(path, graph, replace(strategy, mesh=Mesh.grid(1, 4), dp="gpus"), 4, "gpt:tiny")
    assert load_plan(path, graph, 4).dp == ("gpus",)
    doc = json.loads(path.read_text())
    doc["dp"] = "gpus"  # as files wrote it before the axes were a list
    path.write_text(json.dumps(doc))
    assert load_plan(path, graph, 4).dp == ("gpus",)
    doc["dp"] = "tp"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="no axis 'tp'; its axes are .*make the plan again"):
        load_plan(path, graph, 4)
    doc["dp"], doc["axes"] = "x", ["x", "y"]  # the plans' axes go by the cluster's names
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"axes \['x', 'y'\] are not \['machines', 'gpus'\]; "
                                        r"make the plan again"):
        load_plan(path, graph, 4)
    doc = json.loads(path.read_text())
    doc["mesh"] = [3, 2]
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"mesh \[3, 2\] is not \[4\], \[MACHINES"):
        load_plan(path, graph, 4)


def test_placements_per_mesh_dimension(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("dp-megatron", graph, 4, TWO)
    first = next(n for n in graph.ops if n.op.startswith("aten.linear"))
    assert mesh_option(graph, strategy, first.name) == "([S(0), R], [R, S(0)], [R, S(0)]) -> " \
        "[S(0), S(2)]"
    assert mesh_option(graph, replace(strategy, mesh=None, dp=None), first.name) == \
        str(strategy.options[first.name])


def test_plan_cli_mesh(capsys):
    assert plan_main(["--model", "gpt:tiny", "--cluster", "v100-8x8-10gbps", "--gpus", "16",
                      "--mesh", "2x8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mesh"] == [2, 8] and "dp-megatron" in doc["plans"]  # (batch 8: no ddp)
    with pytest.raises(SystemExit):
        plan_main(["--model", "gpt:tiny", "--gpus", "16", "--mesh", "3x8"])
    assert "--mesh 3x8: 3 x 8 is not the 16 GPUs of --gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--model", "gpt:tiny", "--gpus", "16", "--mesh", "two"])
    assert "--mesh two: give MACHINESxGPUS (e.g. 8x8) or MACHINESxBLOCKSxGPUS" in \
        capsys.readouterr().err


def test_a_mesh_priced_far_over_the_other_has_only_its_best_plan_lowered(monkeypatch):
    """bert-sgmoe:paper (2 layers) on 2 x 8 GPUs, the 2-D programme without flat options (each
    op over a machine's ranks): its best plan is priced over twice the 1-D one's (the experts'
    gradients cross the 10 Gbit/s link), so the search lowers
    only its best (as it is, with its parameters stored sharded, and stored sharded across the
    machines), each with one micro-batch only: its estimate with one is over twice the fastest
    ranked, and with k micro-batches it is at least half that (HOPELESS). The search chooses
    what it chooses lowering them all."""
    import hidup.planning.ranking as ranking
    spec = get_model("bert-sgmoe:paper", gpus=16, layers=2)
    graph = capture_model(spec, spec.batch)
    profile = load_profile("v100-8x8-10gbps")
    found = search(graph, 16, profile, SearchOptions(k=2, mesh=Mesh.grid(2, 8), flat=False))
    on_mesh = [name for name, _ in found.candidates if "-2d#" in name]
    assert sorted(on_mesh) == ["search-2d#0 k=1", "search-2d#0+across k=1",
                               "search-2d#0+sharded k=1"]
    monkeypatch.setattr(ranking, "BEHIND", float("inf"))
    every = search(graph, 16, profile, SearchOptions(k=2, mesh=Mesh.grid(2, 8), flat=False))
    assert len([name for name, _ in every.candidates if "-2d#" in name]) > 6
    assert every.candidates[0] == found.candidates[0]
    best_2d = min(t for name, t in every.candidates if "-2d#" in name)
    assert best_2d > 2 * every.estimate.step_time  # it was far behind indeed
    by_count = {}
    for r in every.ranked:
        by_count.setdefault(r.name, {})[r.k] = r.step_time
    pairs = [times for times in by_count.values() if len(times) == 2]
    assert len(pairs) > 10 and all(times[2] >= times[1] / 2 for times in pairs)


def test_storage_over_the_dp_axes_that_cannot_be_is_refused_naming_the_axes(tiny_graphs):
    """On a 2 x 2 x 2 mesh, hsdp+tp stores parameters sharded along `outer`: a dim that its
    piece does not have, or that the piece is split on already, is refused in words of the
    mesh's axes (not of 2-D's machines)."""
    _, _, graph = tiny_graphs["gpt:tiny"]
    strategy = fixed_strategy("hsdp+tp", graph, 8, Mesh.grid(2, 2, 2))
    assert strategy.across_axes == ("outer",)
    bias = "p_blocks_0_q_bias"  # (32,), split over the gpus axis: a piece of 16
    assert bias not in strategy.across and str(strategy.home(bias)) == "S(0)"
    with pytest.raises(LoweringError, match=r"parameter p_blocks_0_q_bias cannot be stored "
                                            r"sharded along outer: dim 1 of its piece \[16\] "
                                            r"\(as split inside each machine\) does not split "
                                            r"into 2; keep it whole there"):
        lower(graph, replace(strategy, across={**strategy.across, bias: 1}), 8)
    with pytest.raises(LoweringError, match=r"sharded along outer: it is split on dim 0 inside "
                                            r"each machine already"):
        lower(graph, replace(strategy, across={**strategy.across, bias: 0}), 8)


def test_the_groups_along_any_axes_are_the_ranks_differing_only_there():
    """Mesh.groups against its definition, on meshes of 1 to 4 axes and every set of axes in
    any order: each group the ranks that differ only in those axes' coordinates (row-major
    among them), the groups in row-major order of the other axes; made once per mesh and axes."""
    import itertools

    for shape in [(4,), (2, 4), (3, 5), (2, 2, 2), (2, 3, 4), (1, 8), (2, 2, 2, 3)]:
        names = tuple(f"a{i}" for i in range(len(shape)))
        mesh = Mesh(shape, names)
        coords = {r: mesh.coords(r) for r in range(mesh.world)}
        for count in range(len(shape) + 1):
            for axes in itertools.permutations(names, count):
                inside = sorted(names.index(a) for a in axes)
                rest = [j for j in range(len(shape)) if j not in inside]
                by_rest: dict[tuple, list] = {}
                for r in sorted(coords, key=lambda r: ([coords[r][j] for j in rest],
                                                       [coords[r][j] for j in inside])):
                    by_rest.setdefault(tuple(coords[r][j] for j in rest), []).append(r)
                assert mesh.groups(axes) == tuple(map(tuple, by_rest.values())), (shape, axes)
    big = Mesh((12500, 8))
    assert big.groups("gpus") is big.groups(("gpus",))  # made once
    assert len(big.groups("machines")) == 8 and big.groups("machines")[1][:2] == (1, 9)


@pytest.mark.parametrize("name, mesh", [("fsdp+tp", (2, 2)), ("hsdp+tp", (2, 2, 2)),
                                        ("tp+ep", (2, 2)), ("turned fsdp+tp", (2, 2)),
                                        ("fsdp", (4,))])
def test_a_parameters_storage_is_one_dtensor_placement_per_axis(name, mesh):
    """Strategy.storage: a parameter's stored placement on each mesh axis, and each rank's
    piece of it (hidup.runtime.layout.piece, what the executor holds and checkpoints write) is
    DTensor's local shard of those placements at that rank's coordinate, on 2-D meshes (FSDP
    across the machines with tensor parallelism inside, the turned mesh, experts over every
    GPU) and 3-D (hybrid sharding over the middle axis)."""
    import torch
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from hidup.runtime.layout import piece, whole_shape

    spec = get_model("bert-sgmoe:tiny" if name == "tp+ep" else "gpt:tiny", gpus=math.prod(mesh))
    graph = capture_model(spec, spec.batch)
    grid = Mesh.grid(*mesh) if len(mesh) > 1 else Mesh.line(mesh[0])
    strategy = fixed_strategy(name.split()[-1], graph, grid.world, grid if len(mesh) > 1 else None)
    if name.startswith("turned"):
        strategy = turn(strategy)
        grid = strategy.mesh
    kinds = set()
    for param in graph.params:
        placements = strategy.storage(param.name, grid.world)
        assert len(placements) == len(grid.names)
        kinds.add(tuple(map(str, placements)))
        full = torch.arange(param.out.numel).reshape(param.out.shape)
        for rank in range(grid.world):
            shape, offset = _compute_local_shape_and_global_offset(
                full.shape, grid.shape, list(grid.coords(rank)), placements)
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            mine = piece(full, placements, grid, rank)
            assert torch.equal(mine, full[index]), (param.name, placements, rank)
            assert whole_shape(mine.shape, placements, grid) == tuple(full.shape)
    # stored sharded across on a dim of its piece that the split axis does not split already
    # (a column-split weight S(0) inside: S(1) across), or kept whole there (R); on the turned
    # mesh the split axis is the machines, the storage's the GPUs
    pairs = {("S(0)", "R"), ("S(1)", "S(0)"), ("S(0)", "S(1)"), ("R", "S(0)"), ("R", "R")}
    expected = {"fsdp+tp": pairs, "turned fsdp+tp": pairs,
                "hsdp+tp": {("R",) + pair for pair in pairs},  # replicated across the machines
                # the experts over every GPU, Megatron's weights split inside, replicated across
                "tp+ep": {("S(0)", "S(0)"), ("R", "S(0)"), ("R", "S(1)"), ("R", "R")},
                "fsdp": {("S(0)",)}}[name]  # every dim 0 of gpt:tiny divides by 4
    assert kinds == expected, kinds


def test_a_gradient_is_reduced_axis_by_axis_into_its_stored_shard():
    """buckets.reductions: along the axes where a parameter's gradient is a partial sum, a
    reduce-scatter where it is stored sharded (one over every such axis of a dim, in the mesh's
    order) and then an all-reduce where it is stored whole; nothing where it is complete."""
    from hidup.graph.placement import P, Shard
    from hidup.program.buckets import reductions

    axes = ("machines", "outer", "gpus")
    assert reductions((P, P, P), (R, R, R), axes) == (("all_reduce", axes, R),)  # DDP
    assert reductions((P, P, Shard(0)), (R, R, Shard(0)), axes) == \
        (("all_reduce", ("machines", "outer"), R),)  # tensor parallel inside, dp across
    assert reductions((P, P, R), (R, Shard(1), R), axes) == (  # hybrid sharding
        ("reduce_scatter", ("outer",), Shard(1)), ("all_reduce", ("machines",), R))
    assert reductions((P, P, P), (Shard(0), Shard(0), Shard(0)), axes) == (
        ("reduce_scatter", axes, Shard(0)),)  # FSDP over every GPU
    assert reductions((P, P, P), (Shard(1), R, Shard(0)), axes) == (
        ("reduce_scatter", ("machines",), Shard(1)), ("reduce_scatter", ("gpus",), Shard(0)),
        ("all_reduce", ("outer",), R))
    assert reductions((R, Shard(0)), (R, Shard(0)), axes[1:]) == ()
    with pytest.raises(LoweringError, match="'gpus'"):
        reductions((R, R), (R, Shard(0)), axes[1:])  # a whole gradient is sliced, not reduced

