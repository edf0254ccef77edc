"""An emulated cluster on one Linux machine (hidup.emulation.netns): H hosts as network
namespaces joined to a switch by links limited with `tc`, as the paper limited its links.

    python -m hidup.emulate up --hosts 2 --ranks-per-host 1 --bandwidth 1gbit [--latency 1ms]
    python -m hidup.emulate run -- -m hidup.train --model gpt:tiny --strategy megatron
    python -m hidup.emulate down

`run` starts torchrun in every host with the rendezvous at host 0 (its arguments after `--` are
torchrun's: `-m MODULE ...` or `SCRIPT ...`). Needs root and iproute2 (`ip`, `tc`). Only
namespaces named hidup-NAME-* are ever made or touched, and whatever `up` made is deleted again
if it fails or is interrupted; `down` deletes them and stops what still runs in them."""
from __future__ import annotations

import argparse
import re
import shutil
import sys

from hidup.cli import Parser
from hidup.emulation.netns import (PROG, Cluster, ClusterError, check_link, check_shape,
                                   require_tools)


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the emulated cluster")
    up.add_argument("--hosts", type=int, default=2, help="emulated machines (default 2)")
    up.add_argument("--ranks-per-host", type=int, default=1,
                    help="torchrun processes per machine (default 1)")
    up.add_argument("--bandwidth", default="1gbit",
                    help="each machine's link rate, each direction, e.g. 100mbit, 10gbit "
                         "(default 1gbit)")
    up.add_argument("--latency", default="0",
                    help="one-way delay added on each machine's link, e.g. 200us (default 0)")
    up.add_argument("--kernel-defaults", action="store_true",
                    help="leave the hosts' delayed ACKs on, as Linux sets a veth up, instead of "
                         "acknowledging at once (to compare; see "
                         "hidup.emulation.netns.Cluster.tune_links)")
    run = sub.add_parser("run", help="run torchrun on every host: run -- -m MODULE ARGS...")
    run.add_argument("--port", type=int, default=29511, help="rendezvous port on host 0")
    run.add_argument("command", nargs=argparse.REMAINDER,
                     help="torchrun's arguments after --: -m MODULE ... or SCRIPT ...")
    link = sub.add_parser("link", help="change the links' rate or latency of a running cluster")
    link.add_argument("--bandwidth", help="new link rate, e.g. 100mbit")
    link.add_argument("--latency", help="new one-way delay, e.g. 1ms")
    link.add_argument("--down", type=int, metavar="HOST", default=None,
                      help="cut host HOST off the switch (a lost machine)")
    link.add_argument("--up", type=int, metavar="HOST", default=None,
                      help="reconnect host HOST")
    sub.add_parser("down", help="stop everything in the cluster and delete it")
    sub.add_parser("status", help="print the cluster's shape and links")
    for p in (up, run, link, sub.choices["down"], sub.choices["status"]):
        p.add_argument("--name", default="default",
                       help="which emulated cluster (letters and digits; default 'default')")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9]{1,8}", args.name):
        ap.error(f"--name {args.name!r}: 1 to 8 lower-case letters or digits")
    if args.cmd == "run":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not args.command:
            ap.error("run needs a command after --, e.g. run -- -m hidup.train --model gpt:tiny")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.cmd == "up":
            check_shape(args.hosts, args.ranks_per_host)
            check_link(args.bandwidth, args.latency)
            cluster = Cluster(args.name, args.hosts, args.ranks_per_host, args.bandwidth,
                              args.latency, tuned=not args.kernel_defaults)
            cluster.create()
            print(f"emulated cluster {args.name!r} up: {args.hosts} hosts x {args.ranks_per_host} "
                  f"ranks, links {args.bandwidth} latency {args.latency}"
                  f"{'' if cluster.tuned else ' (kernel defaults)'} "
                  f"(namespaces {', '.join(cluster.namespaces)}); `{PROG} down` removes it")
        elif args.cmd == "down":
            cluster = Cluster(args.name, 0, 1, "1gbit")
            gone = cluster.destroy() if shutil.which("ip") else []
            print(f"emulated cluster {args.name!r} down: deleted {', '.join(gone) or 'nothing'}")
        elif args.cmd == "status":
            c = Cluster.load(args.name)
            print(f"emulated cluster {c.name!r}: {c.hosts} hosts x {c.ranks_per_host} ranks, "
                  f"links {c.bandwidth} latency {c.latency}"
                  f"{' (tuned)' if c.tuned else ' (kernel defaults)'}")
        elif args.cmd == "link":
            c = Cluster.load(args.name)
            for host, up in ((args.down, False), (args.up, True)):
                if host is not None:
                    c.set_host_link(host, up)
                    print(f"emulated cluster {c.name!r}: host {host} {'re' if up else 'cut off'}"
                          f"{'connected' if up else ''}")
            if args.bandwidth or args.latency or (args.down is None and args.up is None):
                c.set_link(args.bandwidth, args.latency)
                print(f"emulated cluster {c.name!r}: links now {c.bandwidth} latency {c.latency}")
        else:
            require_tools()
            c = Cluster.load(args.name)
            try:
                result = c.run(args.command, args.port)
            except KeyboardInterrupt:
                print(f"{PROG}: interrupted; every host's ranks were stopped", file=sys.stderr)
                return 130
            if not result.ok:
                print(f"{PROG}: {result.failure()}", file=sys.stderr)
                return next(code for code in result.codes if code != 0)
    except ClusterError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
