"""Independent subprocess runs started together, two at a time, and awaited where a test reads them.

A recipe launch spends most of its first ~10 s importing torch and torchtitan on one core, so two
independent launches side by side take little longer than one. Jobs are plain callables (usually
``subprocess.run`` wrappers); a job's exception is raised where its result is read."""

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

WORKERS = 2


class Runs:
    """``jobs`` (name → callable) start now, in order, ``workers`` at a time; ``runs[name]`` waits."""

    def __init__(self, jobs: dict[str, Callable], workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(max(1, workers))
        self._futures = {name: self._pool.submit(fn) for name, fn in jobs.items()}

    def __getitem__(self, name: str):
        return self._futures[name].result()

    def __contains__(self, name: str) -> bool:
        return name in self._futures

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Jobs(dict):
    """A module fixture's launches, name → job: ``add(tests, name, fn)`` queues ``fn(folder)`` in a fresh
    folder ``name`` where any of the space-separated ``tests`` runs this session; the job returns
    (``fn``'s result, the folder). Hand it to ``Runs``."""

    def __init__(self, request, tmp_path_factory):
        super().__init__()
        self._request, self._tmp = request, tmp_path_factory

    def add(self, tests: str, name: str, fn: Callable) -> None:
        if any(selected(self._request, t) for t in tests.split()):
            folder = self._tmp.mktemp(name)
            self[name] = lambda: (fn(folder), folder)


def selected(request, test_name: str) -> set[str]:
    """Parameter ids of ``test_name`` (in the requesting module) that this pytest session will run."""
    return {item.callspec.id if hasattr(item, "callspec") else "" for item in request.session.items
            if item.module is request.module and item.originalname == test_name}
