"""hidup.emulate and hidup.emulation.netns: clear errors without root or for bad flags; with root
and iproute2, a real emulated cluster whose ranks meet across hosts over rate-limited links, a
failing rank that ends the run in bounded time, and nothing left behind."""
from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time

import pytest

from hidup.cli import parse_rate, parse_seconds
from hidup.emulate import main
from hidup.emulation import netns
from hidup.emulation.netns import Cluster, ClusterError, emulated

ROOT = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
needs_root = pytest.mark.skipif(not ROOT, reason="needs root and iproute2 (network namespaces)")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_rates_and_latencies_parse_or_say_how_to_write_them():
    assert parse_rate("1gbit") == 1e9 / 8
    assert parse_rate("100mbit") == 1e8 / 8
    assert parse_seconds("200us") == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="like 0, 200us"):
        parse_seconds("soon")


def test_bad_flags_and_missing_clusters_are_one_line_errors(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    with pytest.raises(SystemExit):
        main(["up", "--name", "Bad Name"])
    assert "1 to 8 lower-case letters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run"])
    assert "run needs a command after --" in capsys.readouterr().err
    assert main(["status", "--name", "nothere"]) == 2
    assert "no emulated cluster 'nothere' is up" in capsys.readouterr().err
    assert main(["up", "--hosts", "0"]) == 2
    assert "--hosts 0: must be 1 to" in capsys.readouterr().err
    assert main(["up", "--bandwidth", "quick"]) == 2
    assert "bandwidth 'quick'" in capsys.readouterr().err


def test_without_root_it_stops_with_a_clear_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["up", "--hosts", "2"]) == 2
    assert "needs root" in capsys.readouterr().err


@needs_root
def test_ranks_meet_across_hosts_and_everything_is_deleted(tmp_path):
    script = tmp_path / "meet.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.ones(4) * (dist.get_rank() + 1)
        dist.all_reduce(x)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {x[0].item():.0f} "
              f"threads {torch.get_num_threads()} cluster {os.environ['HIDUP_CLUSTER']}")
        dist.destroy_process_group()
    """))
    with emulated(2, 2, "1gbit", name="t1") as c:
        made = set(c.namespaces)
        assert made <= set(namespaces())
        tc = subprocess.run(["ip", "netns", "exec", c.host(0), "tc", "qdisc", "show", "dev",
                             "eth0"], capture_output=True, text=True).stdout
        assert "rate 1Gbit" in tc
        route = subprocess.run(["ip", "-n", c.host(1), "route"], capture_output=True,
                               text=True).stdout
        assert "quickack 1" in route and "src 10.87.0.2" in route  # tuned: no delayed ACKs
        result = c.run([str(script)], capture=True, timeout=120)
        assert result.ok, result.failure()
        # ranks of one host share its stdout, so their lines may interleave: count, don't split
        assert "".join(result.stdout).count("of 4 sum 10") == 4, result  # 1+2+3+4 on every rank
        c.set_link("100mbit")
        assert "rate 100Mbit" in subprocess.run(
            ["ip", "netns", "exec", c.host(1), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True).stdout
    assert not made & set(namespaces())


@needs_root
def test_kernel_defaults_keep_delayed_acks_and_status_says_which(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    try:
        assert main(["up", "--name", "t8", "--kernel-defaults"]) == 0
        assert "(kernel defaults)" in capsys.readouterr().out
        route = subprocess.run(["ip", "-n", "hidup-t8-h0", "route"], capture_output=True,
                               text=True).stdout
        assert "10.87.0.0/24" in route and "quickack" not in route
        assert main(["status", "--name", "t8"]) == 0
        assert "(kernel defaults)" in capsys.readouterr().out
    finally:
        main(["down", "--name", "t8"])
    assert not [ns for ns in namespaces() if ns.startswith("hidup-t8-")]


@needs_root
def test_a_failing_rank_ends_the_run_in_bounded_time(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(600)  # rank 0 would wait for ever
    """))
    with emulated(2, 1, "1gbit", name="t2") as c:
        start = time.monotonic()
        result = c.run([str(script)], capture=True, grace=2.0)
        assert time.monotonic() - start < 60
        assert not result.ok and "host 1 exited with code" in result.failure()


@needs_root
def test_a_failed_up_deletes_what_it_made(monkeypatch):
    def broken(self, *args, **kwargs):
        raise ClusterError("tc broke")

    monkeypatch.setattr(Cluster, "_qdisc", broken)
    with pytest.raises(ClusterError, match="tc broke"):
        Cluster("t3", 2, 1, "1gbit").create()
    assert not [ns for ns in namespaces() if ns.startswith("hidup-t3-")]
    assert not Cluster.state_file("t3").exists()
