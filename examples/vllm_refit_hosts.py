"""Where the processes of ``examples/vllm_refit.py`` run (``--hosts``, ``--net``): one host; two
simulated hosts, the trainers and vLLM's workers each under a ``TRITONRESHARD_HOST`` label (``--net
labels``); or the trainers on host 0 of the host harness (:mod:`tritonreshard.apps.hosts`: its own
network namespace, /dev/shm and hostname) while vLLM's engine and workers stay on this machine
(``--net namespaces``). Here: the harness's set-up and the checks of the options, where each side is
placed, the environment vLLM's workers start with, and the run's check that it had the hosts it says.
"""
from __future__ import annotations

import contextlib
import os
import socket

HOST_ENV = "TRITONRESHARD_HOST"   # a process's simulated host identity (docs/hosts.md)
HOSTS = ("trainers", "inference")  # --hosts 2: the trainer processes / vLLM's workers
NETS = ("labels", "namespaces")    # --net: simulated hosts (HOST_ENV) / the host harness's (network namespaces)


def net_problems(args) -> list[str]:
    """What is wrong with ``--net`` for ``args`` (``hosts``, ``net``): namespaces need ``--hosts 2``
    and a host harness this machine can make (root, iproute2, util-linux)."""
    if args.net != "namespaces":
        return []
    if args.hosts != 2:
        return [f"--net namespaces puts the trainers on a host of their own: it needs --hosts 2, got {args.hosts}"]
    from tritonreshard.apps.hosts import unavailable  # only --net namespaces needs the harness

    why = unavailable()
    return [f"--net namespaces: {why}; --net labels runs without it"] if why else []


def harness(args):
    """A context manager for the run: with ``--net namespaces`` a host harness of one host (the
    trainers'), torn down whatever happens, as its value; else None."""
    if args.net == "labels":
        return contextlib.nullcontext()
    from tritonreshard.apps.hosts import Hosts  # --net namespaces only: the harness needs root and iproute2

    return Hosts(1, gateway=True)


def trainer_placement(args, hosts) -> dict:
    """:class:`vllm_refit_trainers.TrainerGroup`'s keywords: with ``--hosts 2`` the trainers on the
    first simulated host (the workers on the second: :func:`label_workers`), or on the harness's
    host 0 (``hosts``, --net namespaces; the workers on this machine); the fraction a step changes."""
    return dict(host=HOSTS[0] if args.hosts == 2 and hosts is None else None, on=hosts, changed=args.changed)


def label_workers(args, hosts) -> None:
    """Before the LLM exists: with ``--hosts 2 --net labels`` vLLM's worker processes inherit the
    second simulated host from this process's environment (checked by :func:`hosts_ok`)."""
    if args.hosts == 2 and hosts is None:
        os.environ[HOST_ENV] = HOSTS[1]


@contextlib.contextmanager
def gloo_on_gateway(hosts):
    """With ``hosts`` (--net namespaces): while vLLM starts its workers (they inherit the driver's
    environment then), ``GLOO_SOCKET_IFNAME`` names this machine's interface on the harness's switch.
    gloo listens where the hostname resolves to unless told an interface, and this machine's may
    resolve to loopback (``/etc/hosts``), which a trainer on ``host0`` cannot reach (its loopback is
    its own); a real node's hostname names an address its peers route to. Restored afterwards: the
    trainers started later (--recover) find their own interface from their hostname."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    if hosts is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = hosts.gateway_interface
    try:
        yield
    finally:
        if hosts is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME")
            if saved is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = saved


def worker_host(worker):
    """(Run in each vLLM worker.) The worker's host identity as tritonreshard sees it: the simulated
    one it inherited from the driver's environment, else its hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def hosts_ok(args, summary, hosts) -> bool:
    """Whether the run had the hosts it says: one host, or (--hosts 2) vLLM's workers really
    inherited their simulated host from the driver, or (--net namespaces) the trainers ran on the
    harness's host 0, under another hostname than the engine's and its workers', and left nothing in
    that host's /dev/shm."""
    if args.hosts == 1:
        return True
    if hosts is None:
        return summary["worker_hosts"] == [HOSTS[1]] * args.tp and summary["trainer_hosts"] == [HOSTS[0]]
    engine, trainers = summary["engine_hostname"], hosts[0].name
    return (summary["trainer_hostnames"] == summary["trainer_hosts"] == [trainers] and engine != trainers
            and summary["worker_hosts"] == [engine] * args.tp and summary["trainer_host_shm"] == [])
