"""Fault injection for the containment tests (tests/connector/test_connector_faults_*.py).

- Servers a test may stop, restart, freeze and cut off are `tools/servers.py`'s
  `PostgresServer` and `RedisServer`, each a private server on loopback (the session-wide
  `postgres_url` / `redis_url` servers are shared with other tests and must never be faulted);
  `shared_extra` puts an engine's disk tier on them. A tmpfs that fills up (`tmpfs`, `fill`).
- The prompts every fault test sends and their no-connector greedy outputs, computed once per
  test session (one baseline engine for every fault module).
- Bounded calls: an engine call that hangs fails its test (`bounded`), and `hang_guard` dumps
  every thread and ends the process should anything else hang (a CI run never blocks forever).
- Reading kvci's fault counter and the disk tier's health gauge from the engine's Prometheus
  registry, and waiting, as a liveness bound, for disk hits to come back.
- What every fault module sets up: its `base` and `no_hang` fixtures (`base_fixture`,
  `no_hang_fixture`), its engine (`ModuleEngine`, a context manager) and the prompts it holds on
  disk only (`persisted_to_disk`).
"""

from __future__ import annotations

import faulthandler
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from engine import BLOCK_SIZE, baseline_outputs, generate_one, greedy, kvci_params

T = TypeVar("T")

RECOVERY_BOUND_S = 30.0
"""A tier back in use within this after its dependency answers (liveness, not performance: the
probe runs at most 4 s apart)."""

ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=16)
"""Every fault engine (and its baseline) prefills 32 tokens a step. A disk hit is loaded only
while this engine measures loading faster than half of recomputing it (LoadOrRecompute); the
tiny model prefills a whole prompt in about one step, about as long as five Redis blobs take to
load, and hits were declined now and then. Chunked, a prompt's measured prefill is six steps:
its disk hits are loaded."""

CALL_BOUND_S = 60.0
"""An engine call that has not returned in this is a hang."""

FAULT_KINDS = ("unavailable", "timeout", "internal")


# ---- filesystems the tests may fill ------------------------------------------------------------


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "6M") mounted on `path` (root only); unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        for _ in range(20):
            done = subprocess.run(["umount", str(path)], capture_output=True)
            if done.returncode == 0:
                break
            time.sleep(0.5)  # busy: an engine still shutting down holds a file
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(filler: Path) -> None:
    """Write `filler` until its filesystem has no free byte left (delete it to free the space)."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError:  # ENOSPC: on to smaller writes
                    break
    finally:
        os.close(fd)


# ---- prompts and their baseline ------------------------------------------------------------------


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(4242)

    def toks(n: int) -> list[int]:
        return [rng.randrange(2, 1000) for _ in range(n)]

    named: dict[str, list[int]] = {}
    for i in range(28):  # persisted before a fault: 5 full blocks, 5 pages
        named[f"kept{i}"] = toks(5 * BLOCK_SIZE + 7)
    for i in range(16):  # sent during a fault: never kept anywhere
        named[f"fresh{i}"] = toks(3 * BLOCK_SIZE + 11)
    for i in range(12):  # RAM floods (4 pages each, each its own tenant)
        named[f"flood{i}"] = toks(4 * BLOCK_SIZE + 5)
    return named


PROMPTS = _prompts()
KEPT_PAGES = 5
ALIVE = [5, 6, 7]  # a tiny request: the engine is alive if it completes

_baselines: dict[str, dict[str, list[int]]] = {}


def baseline(model: Path) -> dict[str, list[int]]:
    """The greedy output tokens of every prompt on an engine without the connector (one engine
    per test session for every fault module)."""
    key = str(model)
    if key not in _baselines:
        outs = baseline_outputs(model, {**PROMPTS, "alive": ALIVE}, **ENGINE)
        _baselines[key] = outs
    return _baselines[key]


def base_fixture() -> Any:
    """A fault module's `base` fixture (`base = base_fixture()`): `baseline(tiny_model)`."""

    @pytest.fixture(scope="module")
    def base(tiny_model: Path) -> dict[str, list[int]]:
        return baseline(tiny_model)

    return base


# ---- bounded engine calls ------------------------------------------------------------------------


def _processes() -> str:
    """What every process is doing (its state and the kernel function it waits in), and where
    py-spy is on PATH, the Python stacks of this process's descendants: for a hang's report."""
    done = subprocess.run(["ps", "-eo", "pid,ppid,stat,pcpu,wchan:24,args", "--sort=-pcpu"],
                          capture_output=True, text=True)
    report = [line[:200] for line in done.stdout.splitlines()[:25]]
    spy = shutil.which("py-spy")
    if spy is not None:
        children: dict[int, list[int]] = {}
        for line in done.stdout.splitlines()[1:]:
            pid, ppid = (int(x) for x in line.split()[:2])
            children.setdefault(ppid, []).append(pid)
        todo, seen = [os.getpid()], []
        while todo:
            for child in children.get(todo.pop(), []):
                seen.append(child)
                todo.append(child)
        for pid in seen:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=20)
                report.append(dump.stdout[-6000:])
            except subprocess.TimeoutExpired:
                report.append(f"py-spy dump of {pid} timed out")
    return "\n".join(report)


_abandoned: list[threading.Thread] = []  # calls that hung: still waiting on their engine


def settle_abandoned(timeout_s: float) -> bool:
    """Wait for the calls that hung to return (a fault undone may release them): True if none
    is left, so the engine is not in two calls at once."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_abandoned):
        thread.join(max(0.0, deadline - time.monotonic()))
        if not thread.is_alive():
            _abandoned.remove(thread)
    return not _abandoned


def bounded(call: Callable[[], T], timeout_s: float = CALL_BOUND_S, what: str = "engine call") -> T:
    """`call()` on a thread of its own; the test fails if it has not returned in `timeout_s`
    (a hang fails, it does not block the run). Its exception is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"bounded {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _abandoned.append(thread)
        print(f"{what} hangs; the processes then:\n{_processes()}", file=sys.stderr)
        pytest.fail(f"{what} did not return within {timeout_s:.0f} s (a hang)", pytrace=False)
    if "error" in box:
        raise box["error"]
    return box["value"]


def send(llm: Any, name: str, timeout_s: float = CALL_BOUND_S, **kvci: Any) -> Any:
    """One request for the prompt `name` with `kvci` params, bounded; its RequestOutput."""
    sp = kvci_params(**kvci) if kvci else greedy()
    return bounded(lambda: generate_one(llm, PROMPTS[name], sp), timeout_s, f"request {name}")


def send_many(llm: Any, names: list[str], timeout_s: float = CALL_BOUND_S,
              **kvci: Any) -> list[Any]:
    """The prompts `names` in one batch (the engine runs them concurrently), bounded."""
    from vllm.inputs import TokensPrompt

    sp = kvci_params(**kvci) if kvci else greedy()
    return bounded(lambda: llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[n]) for n in names],
                                        sp, use_tqdm=False), timeout_s, f"batch of {len(names)}")


def assert_baseline(out: Any, name: str, base: dict[str, list[int]]) -> None:
    assert list(out.outputs[0].token_ids) == base[name], f"{name}: output differs from recomputing"


def assert_alive(llm: Any, base: dict[str, list[int]]) -> None:
    """A further request completes, with the baseline's output."""
    from vllm.inputs import TokensPrompt

    (out,) = bounded(lambda: llm.generate([TokensPrompt(prompt_token_ids=ALIVE)], greedy(),
                                          use_tqdm=False), what="a request after the fault")
    assert list(out.outputs[0].token_ids) == base["alive"]


def hit_tier(out: Any) -> str | None:
    params = out.kv_transfer_params or {}
    return (params.get("kvci") or {}).get("hit_tier")


# ---- kvci's Prometheus series --------------------------------------------------------------------


def faults(llm: Any) -> dict[tuple[str, str], float]:
    """`vllm:kvci_faults{tier,kind}` as (tier, kind) -> count."""
    from vllm.v1.metrics.reader import Counter

    counts: dict[tuple[str, str], float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:kvci_faults", "vllm:kvci_faults_total") and isinstance(m, Counter):
            key = (m.labels.get("tier", ""), m.labels.get("kind", ""))
            counts[key] = counts.get(key, 0.0) + m.value
    return counts


def faults_since(llm: Any, before: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    now = faults(llm)
    return {k: v - before.get(k, 0.0) for k, v in now.items() if v - before.get(k, 0.0) > 0}


def disk_healthy(llm: Any) -> float | None:
    """`vllm:kvci_tier_healthy{tier="disk"}`: 1 healthy, 0 degraded, None when not exported."""
    from vllm.v1.metrics.reader import Gauge

    for m in llm.get_metrics():
        if m.name == "vllm:kvci_tier_healthy" and isinstance(m, Gauge) \
                and m.labels.get("tier") == "disk":
            return m.value
    return None


def wait_healthy(llm: Any, bound_s: float = RECOVERY_BOUND_S) -> None:
    """Step the engine until `vllm:kvci_tier_healthy{tier="disk"}` reads 1 again."""
    deadline = time.monotonic() + bound_s
    while disk_healthy(llm) != 1:
        if time.monotonic() > deadline:
            pytest.fail(f"the disk tier was not healthy again within {bound_s:.0f} s",
                        pytrace=False)
        bounded(lambda: generate_one(llm, ALIVE, greedy(1)), what="a step")
        time.sleep(0.2)


def counter(llm: Any, name: str) -> float:
    from vllm.v1.metrics.reader import Counter

    return sum(m.value for m in llm.get_metrics() if m.name == name and isinstance(m, Counter))


# ---- disk hits -----------------------------------------------------------------------------------


PAGE_BYTES = 16 * 1024  # one block of the tiny model's KV (2 layers, K and V, 2 heads of 32)


def loaded_disk_bytes(llm: Any) -> float:
    """`vllm:kvci_loaded_bytes{tier="disk"}`: bytes the workers loaded from the disk tier (a
    load that failed and was recomputed adds only what it loaded)."""
    from vllm.v1.metrics.reader import Counter

    return sum(m.value for m in llm.get_metrics()
               if m.name == "vllm:kvci_loaded_bytes" and isinstance(m, Counter)
               and m.labels.get("tier") == "disk")


def send_disk(llm: Any, name: str, base: dict[str, list[int]], tenant: str = "acme",
              timeout_s: float = CALL_BOUND_S) -> tuple[Any, bool]:
    """Send a persisted prompt; (its output, checked against the baseline; whether it was
    served from disk: the reply says a disk hit of every page, and the workers loaded them)."""
    before = loaded_disk_bytes(llm)
    out = send(llm, name, timeout_s, tenant=tenant)
    assert_baseline(out, name, base)
    served = (hit_tier(out) == "disk" and out.num_cached_tokens == KEPT_PAGES * BLOCK_SIZE
              and loaded_disk_bytes(llm) - before >= KEPT_PAGES * PAGE_BYTES)
    return out, served


def wait_for_disk_hit(llm: Any, name: str, base: dict[str, list[int]], tenant: str = "acme",
                      bound_s: float = RECOVERY_BOUND_S) -> float:
    """Send `name` until it is served from the disk tier again (loaded, not only found), each
    reply checked against the baseline; the seconds it took. Fails after `bound_s` (a tier
    that never heals)."""
    start = time.monotonic()
    seen: list[Any] = []
    while True:
        out, served = send_disk(llm, name, base, tenant)
        if served:
            return time.monotonic() - start
        seen.append((hit_tier(out), out.num_cached_tokens))
        if time.monotonic() - start > bound_s:
            pytest.fail(f"{name} was not served from disk again within {bound_s:.0f} s of the "
                        f"dependency answering (hit tier, cached tokens: {seen[-5:]})",
                        pytrace=False)
        time.sleep(0.5)


def persist(llm: Any, root: Path, names: list[str], tenant: str = "acme") -> dict[str, str]:
    """Persist each prompt with a valid session credential; name -> checkpoint id."""
    from durable_support import session_token

    token = session_token(root, tenant=tenant)
    ids: dict[str, str] = {}
    for name in names:
        reply = send(llm, name, tenant=tenant, session_token=token, persist=True,
                     source_ids=["doc:handbook"]).kv_transfer_params["kvci"]
        assert (reply.get("persist") or {}).get("status") in ("persisting", "persisted"), \
            (name, {k: v for k, v in reply.items() if k != "recommendation"})
        ids[name] = reply["checkpoint_id"]
    return ids


def step_until(llm: Any, done: Callable[[], bool], what: str, bound_s: float = 60.0) -> None:
    """Run tiny requests (engine steps: queued persist jobs reach the worker) until `done()`."""
    deadline = time.monotonic() + bound_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {bound_s:.0f} s", pytrace=False)
        bounded(lambda: generate_one(llm, ALIVE, greedy(1)), what="a step")
        time.sleep(0.1)


_floods = [0]


def flood_ram(llm: Any, root: Path, rounds: int = 8) -> None:
    """Keep `rounds` new 4-page checkpoints (each under a verified tenant never used before, so
    its pages are new) in RAM, so that an LRU RAM tier of 24 pages has evicted whatever it held
    before (a later lookup of it goes to the disk tier). Each flood tenant is a fair-share pool
    of its own: the tenant that held the tier is then far past its share, and yields it all."""
    from durable_support import session_token

    for i in range(rounds):
        _floods[0] += 1
        tenant = f"flood-{_floods[0]}"
        out = send(llm, f"flood{i}", tenant=tenant, checkpoint="now",
                   session_token=session_token(root, tenant=tenant))
        assert out.kv_transfer_params["kvci"]["tier"] == "ram", out.kv_transfer_params["kvci"]


def evict_to_disk(llm: Any, root: Path, names: list[str], base: dict[str, list[int]],
                  tenant: str = "acme") -> None:
    """Flood the RAM tier until each of `names` (persisted) is served from disk; asserts it."""
    flood_ram(llm, root)
    for name in names:
        out, served = send_disk(llm, name, base, tenant)
        assert served, (name, out.num_cached_tokens, out.kv_transfer_params["kvci"])


def durable_extra(root: Path, **over: Any) -> dict[str, Any]:
    """A durable engine's extra config (see durable_support.setup_dirs) with a 24-page LRU RAM
    tier, so a RAM flood leaves persisted prompts on disk only."""
    from durable_support import setup_dirs

    extra = setup_dirs(root)
    extra.update(ram_bytes=f"{24 * 16}KiB", ram_policy="lru")
    extra.update(over)
    return extra


def shared_extra(root: Path, catalog_url: str, blob_url: str, **over: Any) -> dict[str, Any]:
    """`durable_extra` with the shared disk tier: the catalog in PostgreSQL at `catalog_url`,
    the blobs in Redis at `blob_url` (no disk folder)."""
    extra = durable_extra(root, catalog_url=catalog_url, blob_url=blob_url, **over)
    del extra["disk_root"]
    return extra


def persisted_to_disk(llm: Any, root: Path, names: list[str], base: dict[str, list[int]],
                      catalog_ids: Callable[[], set[str]], tenant: str = "acme",
                      what: str = "the persisted checkpoints reaching the catalog"
                      ) -> dict[str, str]:
    """Persist each prompt (`persist`), step the engine until `catalog_ids()` holds every
    checkpoint, then flood the RAM tier until each is served from disk only (`evict_to_disk`,
    asserted); name -> checkpoint id."""
    ids = persist(llm, root, names, tenant=tenant)
    step_until(llm, lambda: set(ids.values()) <= catalog_ids(), what)
    evict_to_disk(llm, root, names, base, tenant=tenant)
    return ids


# ---- hangs ---------------------------------------------------------------------------------------


@contextmanager
def hang_guard(seconds: float) -> Iterator[None]:
    """Should the process still be inside this after `seconds`, dump every thread's stack and
    exit (a hang that `bounded` cannot catch, e.g. in a fixture's teardown)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def no_hang_fixture(seconds: float) -> Any:
    """A fault module's autouse `no_hang` fixture (`no_hang = no_hang_fixture(s)`): each test
    runs under `hang_guard(seconds)`."""

    @pytest.fixture(autouse=True)
    def no_hang() -> Iterator[None]:
        with hang_guard(seconds):
            yield

    return no_hang


def unblock_fifo(path: Path) -> None:
    """Wake every reader blocked opening the FIFO at `path` (it then reads end of file)."""
    for _ in range(50):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader has it open (any more); ENOENT: gone
            return
        os.close(fd)
        time.sleep(0.05)


# ---- a module's engine, started again should a test have killed it -----------------------------


class ModuleEngine:
    """A module's shared engine. `llm` is the running engine; should an earlier test of the
    module have left it dead (a fault that escaped kvci kills vLLM's engine core), `alive()`
    starts another on the same configuration first, so that each test is judged on its own
    fault (and `restarts` says how many engines the module needed)."""

    def __init__(self, model: Path, extra: dict[str, Any], base: dict[str, list[int]]) -> None:
        self.model, self.extra, self.base = model, extra, base
        self.restarts = 0
        self.llm = self._start()

    def _start(self) -> Any:
        from engine import make_llm

        return make_llm(self.model, self.extra, disable_log_stats=False, **ENGINE)

    def alive(self) -> Any:
        """The engine, after a request proved it alive (a new one if it was dead)."""
        try:
            if not settle_abandoned(30.0):
                raise RuntimeError("a call that hung in an earlier test has not returned")
            assert_alive(self.llm, self.base)
        except (Exception, pytest.fail.Exception) as exc:  # dead (or hung) since an earlier test
            print(f"the module's engine was dead ({type(exc).__name__}: {exc}): restarting",
                  file=sys.stderr)
            self.close()
            self.restarts += 1
            self.llm = self._start()
        return self.llm

    def close(self) -> None:
        from engine import shutdown

        try:
            shutdown(self.llm)
        except Exception as exc:
            print(f"engine shutdown failed: {exc}", file=sys.stderr)

    def __enter__(self) -> ModuleEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
