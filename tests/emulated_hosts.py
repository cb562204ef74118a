"""Launch a script on an emulated cluster of hosts: one torchrun agent per "host" on this machine.

    procs = start_hosts(script_args, hosts=2, ranks_per_host=2)      # Popen per agent
    results = wait_hosts(procs, timeout=600)                          # CompletedProcess per agent
    results = run_hosts(script_args, hosts=2, ranks_per_host=2)       # both at once

Each agent is ``python -m torch.distributed.run --nnodes H --node_rank h --nproc_per_node L`` with a
static rendezvous on 127.0.0.1, so its workers see GROUP_RANK = h, LOCAL_WORLD_SIZE = L and global
ranks h·L .. h·L + L - 1, exactly as on a real cluster. On GPUs, agent h gets GPUs h·L .. h·L + L - 1
(``CUDA_VISIBLE_DEVICES``) and its own ``NCCL_HOSTID``, so NCCL treats the agents as separate hosts
(network transport between them, peer memory only inside one).
"""

import os
import socket
import subprocess
import sys

from run_env import compiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_env(host: int, ranks_per_host: int, gpus: bool, env: dict | None = None) -> dict:
    """The environment of agent ``host``: its GPUs and NCCL host id on GPUs, one thread per rank on CPU."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if gpus:
        first = host * ranks_per_host
        e["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(ranks_per_host))
        e["NCCL_HOSTID"] = f"emulated-host-{host}"
    e.update(env or {})
    return e


def agent_cmd(script_args: list[str], host: int, hosts: int, ranks_per_host: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--node_rank", str(host),
            "--nproc_per_node", str(ranks_per_host), "--master_addr", "127.0.0.1", "--master_port", str(port),
            *script_args]


def start_hosts(script_args: list[str], hosts: int = 2, ranks_per_host: int = 2, gpus: bool = False,
                env: dict | None = None, host_envs: list[dict] | None = None, port: int | None = None,
                cwd: str = ROOT) -> list[subprocess.Popen]:
    """Start one torchrun agent per host (``host_envs[h]`` adds to host h's environment)."""
    port = port or free_port()
    procs = []
    for h in range(hosts):
        e = host_env(h, ranks_per_host, gpus, {**(env or {}), **((host_envs or [{}] * hosts)[h])})
        if not gpus and not compiles(script_args):  # CPU runs that compile nothing: tests/run_env.py says why
            e.setdefault("TORCHDYNAMO_DISABLE", "1")
        procs.append(subprocess.Popen(agent_cmd(script_args, h, hosts, ranks_per_host, port), env=e, cwd=cwd,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_hosts(procs: list[subprocess.Popen], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Wait for every agent; on a timeout kill them all and raise with what they printed."""
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"emulated hosts did not finish within {timeout} s")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def run_hosts(script_args: list[str], hosts: int = 2, ranks_per_host: int = 2, timeout: float = 600,
              **kw) -> list[subprocess.CompletedProcess]:
    return wait_hosts(start_hosts(script_args, hosts, ranks_per_host, **kw), timeout)


def check_ok(results: list[subprocess.CompletedProcess]) -> None:
    """Raise with every agent's output tail unless every agent exited 0."""
    if any(r.returncode != 0 for r in results):
        tails = "\n".join(f"--- host {h}: exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
                          for h, r in enumerate(results))
        raise AssertionError(tails)
