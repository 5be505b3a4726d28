"""Test-wide setup: without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any @triton.jit function is defined, i.e. before doublesparse's
kernel modules are imported, which is why it lives here at collection time.

Under pytest-xdist (the README's ``-n auto --dist loadgroup``), each worker runs with its share of
the cores (two workers of two OpenMP threads each on a 2-core box spin-wait on each other), and the
tests that share a module-scoped fixture of their own module (a server, a loaded checkpoint) run
on one worker, so that fixture is built once (:func:`pytest_collection_modifyitems`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _worker_threads() -> int | None:
    """Intra-op threads of one xdist worker (None outside xdist): the cores split evenly."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


_THREADS = _worker_threads()
if _THREADS is not None:
    torch.set_num_threads(_THREADS)
    # server subprocesses started by the tests inherit it (torch reads it at import)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without the plugin
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core on a CPU machine; one on a GPU machine, whose tests are
    not written to share the device (``-n N`` still asks for N)."""
    return 1 if torch.cuda.is_available() else None  # None: xdist's own count (the cores)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    decode on CPU is many tiny ops, and on a shared 2-core box two OpenMP threads spin-wait on each
    other (measured 91 s vs 5.6 s for 32 SmolLM2 tokens). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_PER_TEST_SCOPES = ("function", "class")  # every wider scope is built once and shared
_FIRST = "tests/server/"  # tests that start servers: the longest waits, scheduled before the rest


@pytest.fixture
def poison_empty(monkeypatch):
    """``torch.empty`` fills what it returns with a sentinel while the test runs (NaN for floating
    dtypes, -7 for the rest), so a launcher's outputs must be written whole to pass."""
    full = torch.full

    def empty(*shape, dtype=None, **kw):
        dtype = dtype or torch.get_default_dtype()
        size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return full(size, float("nan") if dtype.is_floating_point else -7, dtype=dtype, **kw)

    monkeypatch.setattr(torch, "empty", empty)


def _module_fixtures(item, module: str) -> list[str]:
    """Names of the module-scoped fixtures defined in ``module`` that ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [n for n in item.fixturenames
            if any(d.scope not in _PER_TEST_SCOPES and d.baseid == module for d in info.name2fixturedefs.get(n) or ())]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Group for ``--dist loadgroup``: tests that share module-scoped fixtures of their own module
    (a server, a loaded checkpoint) get one ``xdist_group``, so the fixtures are built on one
    worker only; each instance of a parametrized fixture (``srv[fake]``, ``srv[real]``) is its
    own group. Conftest fixtures (``one_thread``) are cheap and do not group."""
    by_module: dict[str, list] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        names = _module_fixtures(item, module)
        if names:
            by_module.setdefault(module, []).append((item, names))
    for module, used in by_module.items():
        root = {n: n for _, names in used for n in names}  # union-find: fixtures used together

        def find(n):
            while root[n] != n:
                n = root[n]
            return n
        for _, names in used:
            for n in names[1:]:
                root[find(n)] = find(names[0])
        for item, names in used:
            params = getattr(getattr(item, "callspec", None), "params", {})
            inst = ",".join(f"{n}={params[n]}" for n in sorted(names) if n in params)
            # no "]" or "@" in the name: xdist reads the group after the id's last "@", past any "]"
            inst = inst.replace("@", "_").replace("]", ")")
            item.add_marker(pytest.mark.xdist_group(f"{module}::{min(map(find, names))}/{inst}"))


class _ServerTestsFirst:
    """The server tests move to the front (after pytest's own reordering by fixture parameters),
    so no worker starts a long server test when the others are done."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda it: not it.nodeid.startswith(_FIRST))


def pytest_configure(config):
    config.pluginmanager.register(_ServerTestsFirst(), "server-tests-first")


# A CUDA fault (an illegal address, a device-side assert) leaves the process's CUDA context unusable:
# every later test in that process would fail for it. Under pytest-xdist the worker exits once that
# test's reports are sent, and xdist starts a fresh one (``--max-worker-restart``); without xdist the
# run stops, naming the test.
_CUDA_FAULTS = ("illegal memory access", "misaligned address", "unspecified launch failure",
                "device-side assert", "illegal instruction")
_FAULTED = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is not None and rep.failed and any(f in str(call.excinfo.value) for f in _CUDA_FAULTS):
        item.config.stash[_FAULTED] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield  # the test ran and its reports were logged (under xdist: sent to the controller)
    faulted = item.config.stash.get(_FAULTED, None)
    if faulted is None:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)
    pytest.exit(f"the CUDA context is lost after {faulted}: the remaining tests cannot run in this process",
                returncode=1)
