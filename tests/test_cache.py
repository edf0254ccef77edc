"""hidup.graph.cache and the probes of hidup.graph.saved it keeps: what autograd keeps of an ATen
op, found once and read back by later processes (here: a cleared in-process cache), the same
Saves; nothing written with HIDUP_CACHE=off; an unreadable entry, or one made for another key,
probed again."""
import pickle

import pytest

from hidup.graph import saved
from hidup.graph.cache import cache_folder, write_entry


def _fresh(graph, monkeypatch):
    """The graph as a new process sees it: no probe kept in memory, none on the graph."""
    monkeypatch.setattr(saved, "_PROBED", {})
    graph.__dict__.pop("_backward_saves_of", None)
    return graph


def _all_saves(graph):
    return {n.name: saved.backward_saves(graph, n) for n in graph.ops}


def _no_probe(*args):
    raise AssertionError("probed again")


def test_probes_are_read_back_from_disk_without_probing(tiny_graphs, tmp_path, monkeypatch):
    monkeypatch.setenv("HIDUP_CACHE", str(tmp_path))
    graph = tiny_graphs["gpt:tiny"][2]
    first = _all_saves(_fresh(graph, monkeypatch))
    files = list((tmp_path / "probes").rglob("*.pkl"))
    assert len(files) == len(saved._PROBED) > 10  # one entry per ATen op's key
    monkeypatch.setattr(saved, "_probe", _no_probe)
    assert _all_saves(_fresh(graph, monkeypatch)) == first
    assert any(s.own or s.scratch != (0, 0) for s in first.values())  # not all empty


def test_with_the_cache_off_nothing_is_written(tiny_graphs, tmp_path, monkeypatch):
    monkeypatch.setenv("HIDUP_CACHE", "off")
    monkeypatch.chdir(tmp_path)
    assert cache_folder("probes") is None
    _all_saves(_fresh(tiny_graphs["mlp:tiny"][2], monkeypatch))
    assert not list(tmp_path.rglob("*"))


@pytest.mark.parametrize("damage", ["truncated", "another key"])
def test_an_entry_that_does_not_answer_its_key_is_probed_again(tiny_graphs, tmp_path,
                                                               monkeypatch, damage):
    monkeypatch.setenv("HIDUP_CACHE", str(tmp_path))
    graph = tiny_graphs["mlp:tiny"][2]
    first = _all_saves(_fresh(graph, monkeypatch))
    for path in (tmp_path / "probes").rglob("*.pkl"):
        key, value = pickle.loads(path.read_bytes())
        path.write_bytes(path.read_bytes()[:5] if damage == "truncated"
                         else pickle.dumps(("another " + key, value)))
    probes = []
    real = saved._probe
    monkeypatch.setattr(saved, "_probe", lambda *a: probes.append(a) or real(*a))
    assert _all_saves(_fresh(graph, monkeypatch)) == first
    assert len(probes) == len(saved._PROBED)
    # probed again, each entry is whole once more
    monkeypatch.setattr(saved, "_probe", _no_probe)
    assert _all_saves(_fresh(graph, monkeypatch)) == first


def test_an_entry_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "kind" / "entry.pkl"
    assert write_entry(path, lambda f: pickle.dump({"a": 1}, f))
    assert pickle.loads(path.read_bytes()) == {"a": 1}

    def fails(f):
        f.write(b"half")
        raise TypeError("cannot pickle")
    assert not write_entry(path, fails)
    assert pickle.loads(path.read_bytes()) == {"a": 1}  # the entry before, and no leftover
    assert [p.name for p in path.parent.iterdir()] == ["entry.pkl"]
