"""experiments.suite_profile: a py-spy raw profile of the suite summed by work and by process."""
import pytest

from experiments import suite_profile


def test_samples_count_under_their_first_kind_of_work_and_their_process(tmp_path, capsys):
    pytest_cmd = 'process 1:"python -m pytest -q"'
    rank = 'process 2:"/usr/bin/python -B -c from multiprocessing.forkserver import main; main()"'
    train = 'process 3:"/usr/bin/python -u -m hidup.train --model gpt:tiny"'
    raw = tmp_path / "suite.raw"
    raw.write_text("\n".join([
        f"{pytest_cmd};{rank};run (hidup/runtime/execute.py:9);trace_step (hidup/runtime/step.py:4);"
        f"wrapped (torch/fx/experimental/proxy_tensor.py:3) 30",
        f"{pytest_cmd};{train};<module> (hidup/train.py:1);_find_and_load (<frozen importlib>:1);"
        f"trace_step (hidup/runtime/step.py:4) 10",
        f"{pytest_cmd};lower (hidup/program/lowering.py:467) 20",
        f"{pytest_cmd};main (examples/own_model.py:3) 20",
        "not a sample line",
    ]) + "\n")
    assert suite_profile.main([str(raw), "--rate", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("80 samples, 8.0 CPU s")
    # an import anywhere in a stack is import time, whatever it runs
    assert "| recording a training step (hidup.runtime.step.trace_step) | 3.0 | 37.5% |" \
        in out
    assert "| module imports | 1.0 | 12.5% |" in out
    assert "| lowering (hidup.program) | 2.0 | 25.0% |" in out and "| other | 2.0 | 25.0% |" in out
    assert "| the tests' gloo ranks (forked from their forkserver) | 3.0 | 37.5% |" in out
    assert "| `python -m hidup.train` | 1.0 | 12.5% |" in out
    assert "| pytest (and ranks on its threads) | 4.0 | 50.0% |" in out


def test_a_file_without_samples_is_refused_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.raw"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit) as exc:
        suite_profile.main([str(empty)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no py-spy raw samples" in err and err.count("\n") == 1
