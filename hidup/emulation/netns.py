"""The emulated cluster on one Linux machine: H hosts as network namespaces, each joined to a
switch (a bridge in a namespace of its own) by a veth link limited with `tc`, as the paper
limited its links. Ranks of one host talk over loopback; ranks of different hosts over the
limited links (both directions of a host's link run at the rate; a host receiving from several
others shares its link, as at a real switch).

`Cluster` makes, changes and deletes one (its namespaces, switch and links) and runs torchrun in
every host with the rendezvous at host 0; `emulated` is a Cluster that is up inside a `with`
block. The command `python -m hidup.emulate` drives it from the shell. Needs root and iproute2
(`ip`, `tc`). Only namespaces named hidup-NAME-* are ever made or touched, and whatever `create`
made is deleted again if it fails or is interrupted; `destroy` deletes them and stops what still
runs in them."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from hidup.cli import parse_rate, parse_seconds

PROG = "python -m hidup.emulate"
STATE_DIR = Path(os.environ.get("HIDUP_CLUSTER_DIR", "/run/hidup-cluster"))
SUBNET = "10.87.0"  # host i is SUBNET.(i+1), inside the cluster's own namespaces only
IFACE = "eth0"  # each host's link to the switch, as its namespace sees it
MAX_HOSTS = 32


class ClusterError(Exception):
    """Something the user can fix: bad flags, no root or iproute2, no such cluster."""


@dataclass
class Cluster:
    """One emulated cluster: its hosts' namespaces and the figures of their links."""

    name: str
    hosts: int
    ranks_per_host: int
    bandwidth: str  # tc rate of every link, each direction
    latency: str = "0"  # one-way delay added on each host's outgoing link
    tuned: bool = True  # hosts acknowledge at once (see tune_links); False: delayed ACKs, as
    # Linux sets a veth up

    @property
    def switch(self) -> str:
        return f"hidup-{self.name}-sw"

    def host(self, i: int) -> str:
        return f"hidup-{self.name}-h{i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch] + [self.host(i) for i in range(self.hosts)]

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- state ------------------------------------------------------------------------------
    @staticmethod
    def state_file(name: str) -> Path:
        return STATE_DIR / f"{name}.json"

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_file(self.name).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, name: str) -> Cluster:
        path = cls.state_file(name)
        if not path.is_file():
            raise ClusterError(f"no emulated cluster {name!r} is up (no {path}); start one with "
                               f"`{PROG} up --hosts 2 --ranks-per-host 1 --bandwidth 1gbit`")
        return cls(**json.loads(path.read_text()))

    # -- links ------------------------------------------------------------------------------
    def _qdisc(self, ns: str, dev: str, delay: str, verb: str = "add") -> None:
        """Limit `dev`'s outgoing rate with a token bucket (tbf), whose bucket holds 1 ms of
        traffic (at least 64 KiB, one offloaded packet); a delay needs netem under it."""
        rate = parse_rate(self.bandwidth)
        tbf = ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(max(2 ** 16, int(rate * 1e-3))),
               "latency", "100ms"]
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
        if parse_seconds(delay) == 0:
            _run(tc + [verb, "dev", dev, "root", "handle", "1:"] + tbf)
            return
        if verb == "replace":
            _run(tc + ["del", "dev", dev, "root"], check=False)
        netem = _run(tc + ["add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                           f"{parse_seconds(delay) * 1e6:.0f}us", "limit", "100000"], check=False)
        if netem.returncode != 0:
            raise ClusterError(f"--latency {delay}: this kernel has no netem qdisc "
                               f"({netem.stderr.strip()}); use --latency 0 (rate limits need tbf "
                               f"only)")
        _run(tc + ["add", "dev", dev, "parent", "1:", "handle", "2:"] + tbf)

    def tune_links(self) -> None:
        """Every host acknowledges at once (its route's `quickack`): with delayed ACKs a gloo
        collective that runs out of send window waits for the receiver's timer, stalls of tens
        of ms at random that would swamp what the emulated cluster is there to test. Measured
        on this project's 2-core VM (10 Gbit/s pair, 20 rounds of 100 back-to-back gloo
        all-reduces of 256 KB, `experiments.link_noise`): with the kernel's delayed ACKs 59
        calls took 10-90 ms, 31% of all the time, and the rounds' means ranged 0.74-7.05 ms;
        acknowledging at once, 1 call (0%) and 1.15-2.75 ms. The rates (tbf) are untouched."""
        for i in range(self.hosts):
            _ip(["-n", self.host(i), "route", "replace", f"{SUBNET}.0/24", "dev", IFACE, "proto",
                 "kernel", "scope", "link", "src", self.address(i), "quickack", "1"])

    def set_link(self, bandwidth: str | None = None, latency: str | None = None) -> None:
        """Change every link's rate (and latency) in place; the hosts keep running."""
        self.bandwidth = bandwidth or self.bandwidth
        self.latency = latency if latency is not None else self.latency
        check_link(self.bandwidth, self.latency)
        for i in range(self.hosts):
            self._qdisc(self.host(i), IFACE, self.latency, "replace")
            self._qdisc(self.switch, f"h{i}", "0", "replace")
        self.save()

    def set_host_link(self, host: int, up: bool) -> None:
        """Cut one host off the switch (its link down) or reconnect it: a lost machine."""
        if not 0 <= host < self.hosts:
            raise ClusterError(f"host {host}: the cluster {self.name!r} has hosts 0 to "
                               f"{self.hosts - 1}")
        _ip(["-n", self.switch, "link", "set", f"h{host}", "up" if up else "down"])

    # -- lifecycle --------------------------------------------------------------------------
    def create(self) -> None:
        """Make the namespaces, the switch and the links; on any failure (or Ctrl-C) delete
        whatever was made and raise."""
        require_tools()
        taken = [ns for ns in self.namespaces if ns in _namespaces()]
        if taken or self.state_file(self.name).exists():
            what = ", ".join(taken) or str(self.state_file(self.name))
            raise ClusterError(f"emulated cluster {self.name!r} is already up ({what}); "
                               f"`{PROG} down --name {self.name}` first, or choose another --name")
        try:
            with _deferred_signals():
                self.save()  # first, so that `down` finds a half-made cluster too
                for ns in self.namespaces:
                    _run(["ip", "netns", "add", ns])
                    _ip(["-n", ns, "link", "set", "lo", "up"])
                _ip(["-n", self.switch, "link", "add", "br0", "type", "bridge"])
                _ip(["-n", self.switch, "link", "set", "br0", "up"])
                for i in range(self.hosts):
                    host, port = self.host(i), f"h{i}"
                    _ip(["link", "add", IFACE, "netns", host, "type", "veth", "peer", "name", port,
                         "netns", self.switch])
                    _ip(["-n", self.switch, "link", "set", port, "master", "br0"])
                    _ip(["-n", self.switch, "link", "set", port, "up"])
                    _ip(["-n", host, "addr", "add", f"{self.address(i)}/24", "dev", IFACE])
                    _ip(["-n", host, "link", "set", IFACE, "up"])
                    self._qdisc(host, IFACE, self.latency)
                    self._qdisc(self.switch, port, "0")
                if self.tuned:
                    self.tune_links()
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> list[str]:
        """Stop what runs in this cluster's namespaces and delete them; returns those deleted."""
        mine = re.compile(rf"hidup-{re.escape(self.name)}-(sw|h[0-9]+)")
        gone = []
        for ns in _namespaces():
            if not mine.fullmatch(ns):
                continue
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
            gone.append(ns)
        self.state_file(self.name).unlink(missing_ok=True)
        return gone

    # -- running ----------------------------------------------------------------------------
    def torchrun(self, i: int, args: list[str], port: int) -> list[str]:
        """The command that starts host i's ranks (run it under `ip netns exec`)."""
        return ["ip", "netns", "exec", self.host(i), sys.executable, "-m",
                "torch.distributed.run", "--nnodes", str(self.hosts), "--node-rank", str(i),
                "--nproc-per-node", str(self.ranks_per_host), "--master-addr", self.address(0),
                "--master-port", str(port)] + list(args)

    def run(self, args: list[str], port: int = 29511, capture: bool = False,
            timeout: float | None = None, grace: float = 20.0) -> Run:
        """Run `torchrun ... args` on every host at once and wait. If one host fails, the others
        get `grace` seconds to finish, then are stopped; Ctrl-C stops all of them."""
        missing = [ns for ns in self.namespaces if ns not in _namespaces()]
        if missing:
            raise ClusterError(f"emulated cluster {self.name!r} is missing {missing}; "
                               f"`{PROG} down --name {self.name}` and `up` again")
        env = dict(os.environ, GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE,
                   HIDUP_CLUSTER=self.name, HIDUP_RANKS_PER_MACHINE=str(self.world))
        files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) if capture
                 else (None, None) for _ in range(self.hosts)]
        procs = [subprocess.Popen(self.torchrun(i, args, port), env=env, stdout=out, stderr=err,
                                  text=True, start_new_session=True)
                 for i, (out, err) in enumerate(files)]
        start, deadline, first = time.monotonic(), None, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if timeout is not None and now - start > timeout:
                    raise TimeoutError(f"emulated cluster run exceeded {timeout:.0f} s")
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if deadline is None and failed:
                    deadline, first = now + grace, failed[0]
                if deadline is not None and now > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # whatever still runs: a failed peer or an interrupt
                if p.poll() is None:
                    _kill_group(p)
        codes = [p.wait() for p in procs]
        texts = [tuple(_read(f) for f in pair) for pair in files]
        return Run(codes, [t[0] for t in texts], [t[1] for t in texts], first)


@dataclass
class Run:
    """Exit code, stdout and stderr of each host's torchrun (output only when captured)."""

    codes: list[int]
    stdout: list[str | None]
    stderr: list[str | None]
    first_failed: int | None = None  # the host that failed first (the others were stopped)

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.codes)

    def failure(self) -> str:
        """The first failed host's last lines of stderr."""
        order = ([self.first_failed] if self.first_failed is not None else []) + \
            list(range(len(self.codes)))
        for i in order:
            code = self.codes[i]
            if code != 0:
                tail = "\n".join((self.stderr[i] or "").strip().splitlines()[-15:])
                return f"host {i} exited with code {code}" + (f":\n{tail}" if tail else "")
        return "all hosts succeeded"


@contextmanager
def emulated(hosts: int, ranks_per_host: int, bandwidth: str, latency: str = "0",
             name: str | None = None):
    """A Cluster that is up inside the block and always deleted after it."""
    cluster = Cluster(name or f"x{os.getpid()}", hosts, ranks_per_host, bandwidth, latency)
    check_shape(hosts, ranks_per_host)
    check_link(bandwidth, latency)
    cluster.create()
    try:
        with _sigterm_as_interrupt():
            yield cluster
    finally:
        cluster.destroy()


# -- helpers ---------------------------------------------------------------------------------

def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _ip(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip"] + args, check)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines()
            if line.strip()]


def require_tools() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: the emulated cluster needs "
                           f"iproute2 (e.g. `apt-get install iproute2`)")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (it creates network namespaces and "
                           "tc rate limits); run it as root, e.g. with sudo")


def check_shape(hosts: int, ranks_per_host: int) -> None:
    if not 1 <= hosts <= MAX_HOSTS:
        raise ClusterError(f"--hosts {hosts}: must be 1 to {MAX_HOSTS}")
    if ranks_per_host < 1:
        raise ClusterError(f"--ranks-per-host {ranks_per_host}: must be at least 1")


def check_link(bandwidth: str, latency: str) -> None:
    try:
        parse_rate(bandwidth)
        parse_seconds(latency)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process's group (torchrun and its ranks), SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read(file) -> str | None:
    if file is None:
        return None
    with file:
        file.seek(0)
        return file.read()


@contextmanager
def _deferred_signals():
    """Hold SIGINT/SIGTERM while a step must finish (a half-made link); after it, the signal
    takes effect as it would have (the command's own handler: one line, exit 130)."""
    got = []
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        handler = old[got[0]]
        if callable(handler):
            handler(got[0], None)
        raise KeyboardInterrupt


@contextmanager
def _sigterm_as_interrupt():
    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
