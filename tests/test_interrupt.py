"""Ctrl-C ends a command in one line at every point of its life (hidup.cli): during its imports,
inside a callback, and mid-step with collectives in flight."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_ctrl_c_during_the_imports_is_said_at_once_and_ends_it_after_them():
    # raising inside an import can be swallowed (torch's C extension imports numpy that way)
    done = _run("""
        import os, signal
        from hidup.cli import end_on_interrupt
        end_on_interrupt("prog", importing=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("the imports go on")
        end_on_interrupt("prog")
        print("not reached")
    """)
    assert (done.returncode, done.stdout, done.stderr) == (130, "the imports go on\n",
                                                          "prog: interrupted\n"), done


def test_ctrl_c_inside_a_callback_is_raised_again_not_printed_and_lost():
    done = _run("""
        import os, signal
        from hidup.cli import end_on_interrupt
        end_on_interrupt("prog")

        class Dropped:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100000):  # the handler raises SystemExit here, in __del__
                    pass

        Dropped()
        for _ in range(10000000):
            pass
        print("not reached")
    """)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "prog: interrupted\n"), done


def test_an_interrupted_rank_ends_without_torchs_warning_of_collectives_in_flight(tmp_path):
    done = _run(f"""
        import os, signal
        import torch, torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from hidup.cli import end_on_interrupt, exit_main

        def main():
            end_on_interrupt("prog")
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0,
                                    world_size=1)
            pending = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)  # not waited
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10000000):
                pass
            return 0

        exit_main(main)
    """)
    assert (done.returncode, done.stderr) == (130, "prog: interrupted\n"), done
