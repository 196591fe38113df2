"""The options of a command whose work runs as jobs (``ivq diagnose``, ``ivq tune --sweep``): ``--executor``,
``--workers``, ``--ray-address`` (:mod:`ivq_debug.executor`), declared and read in one place."""

from __future__ import annotations

import argparse

from ivq_debug.errors import UsageError
from ivq_debug.executor import EXECUTORS, Executor, make_executor


def add_executor_arguments(p: argparse.ArgumentParser, jobs: str, default: str) -> None:
    """``--executor`` / ``--workers`` / ``--ray-address``; ``jobs`` names what becomes jobs, ``default`` what
    happens without ``--executor``."""
    p.add_argument("--executor", choices=list(EXECUTORS), default=None,
                   help=f"run {jobs} as jobs: local (a process pool of --workers) or ray (a Ray cluster, "
                        f"--ray-address; pip install 'ivq-debug[ray]'); default: {default}")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="--executor local: worker processes "
                                                                          "(default 1: in this process)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="--executor ray: the cluster (ray.init(address=...); 'auto': the one `ray start` runs here; "
                        "default: a new local one for the run)")


def executor_from_args(args: argparse.Namespace, implied: bool = False) -> Executor | None:
    """The executor the options name; None without ``--executor`` (nor ``--workers`` / ``--ray-address`` /
    ``implied``, which imply ``local``, or ``ray`` with an address)."""
    if args.executor is None and (args.workers is not None or args.ray_address or implied):
        args.executor = "ray" if args.ray_address else "local"
    if args.ray_address and args.executor != "ray":
        raise UsageError("--ray-address needs --executor ray")
    if args.workers is not None and args.executor == "ray":
        raise UsageError("--workers is for --executor local (a Ray cluster has its own CPUs)")
    if args.executor is None:
        return None
    return make_executor(args.executor, args.workers or 1, args.ray_address)
