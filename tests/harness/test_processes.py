"""Process ownership: teardown of a whole engine-like tree, orphans, readiness waits, ports.

The tree (tests/fixtures/engine_tree.py) is what real engines look like at teardown time: a
top process holding a /dev/shm segment, workers that share the mapping, one worker that
ignores SIGTERM and one that left the process group with setsid().
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from kvconform.errors import EngineStartError
from kvconform.processes import (
    SHM_CLAIMS_DIR,
    SHM_DIR,
    EngineProcess,
    free_port,
    run_child_session,
    wait_until_ready,
)
from tests.paths import FIXTURES, REPO

FIXTURES = FIXTURES
TREE = FIXTURES / "engine_tree.py"
SHM_PREFIX = "kvconform-selftest-"


def gone(pid: int, within_s: float = 3.0) -> bool:
    """The pid no longer names a live process (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


Launcher = Callable[..., tuple[EngineProcess, dict[str, int], str]]


@pytest.fixture
def launch_tree(tmp_path: Path) -> Iterator[Launcher]:
    """launch_tree("worker,stubborn,escaped") -> (process, pids by role, shm name).

        top (own session, pgid = top) ── maps /dev/shm/<name>
         ├── worker      (same group)
         ├── stubborn    (same group, ignores SIGTERM)
         └── escaped     (setsid: own session and group)

    Whatever a test leaves is killed and unlinked afterwards, so a failing test leaves
    nothing either.
    """
    started: list[tuple[EngineProcess, dict[str, int], str]] = []

    def launch(children: str, clean_exit: bool = False) -> tuple[EngineProcess, dict[str, int], str]:
        shm_name = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ready = tmp_path / f"{shm_name}.ready"
        argv = [sys.executable, str(TREE), shm_name, str(ready), children]
        proc = EngineProcess(
            "fake-engine",
            [*argv, "--clean-exit"] if clean_exit else argv,
            tmp_path / f"{shm_name}.log",
            shm_patterns=[f"{SHM_PREFIX}*"],
        )
        started.append((proc, {}, shm_name))
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert proc.alive(), f"tree died at start:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"tree not up after 15s:\n{proc.log_tail()}"
            time.sleep(0.02)
        pids = json.loads(ready.read_text())
        started[-1] = (proc, pids, shm_name)
        return proc, pids, shm_name

    yield launch
    for proc, pids, shm_name in started:
        proc.stop(grace_s=0.5)
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, 9)
        (SHM_DIR / shm_name).unlink(missing_ok=True)


def test_stop_takes_down_the_whole_tree_and_its_shm(launch_tree: Launcher) -> None:
    proc, pids, shm_name = launch_tree("worker,stubborn,escaped")
    assert set(pids.values()) <= set(proc.pids()), "the escaped child is still a descendant"
    assert shm_name in proc.held_shm()

    t0 = time.monotonic()
    report = proc.stop(grace_s=1.0)
    took = time.monotonic() - t0

    for role, pid in pids.items():
        assert gone(pid), f"{role} ({pid}) survived stop()"
    assert not (SHM_DIR / shm_name).exists()
    assert report.forced_kill, "the stubborn child needs SIGKILL"
    assert report.exit_code == -15  # the top process died of the group's SIGTERM
    assert report.leftover_shm == {shm_name: 1 << 20}
    assert [p.split(":")[0] for p in report.leftover_processes] == [str(pids["escaped"])]
    assert not report.clean
    text = report.describe()
    assert "needed SIGKILL" in text and shm_name in text and str(pids["escaped"]) in text
    assert took < 1.0 + 6.0
    assert proc.stop() is report, "stop() is idempotent"


def test_well_behaved_engine_is_clean(launch_tree: Launcher) -> None:
    proc, pids, shm_name = launch_tree("worker,worker", clean_exit=True)
    proc.pids()
    report = proc.stop(grace_s=5.0)
    assert report.exit_code == 0
    assert not report.forced_kill
    assert report.clean, report.describe()
    assert report.seconds < 3.0
    assert all(gone(pid) for pid in pids.values())
    assert not (SHM_DIR / shm_name).exists()


def test_orphans_of_a_killed_top_process_are_found_and_killed(launch_tree: Launcher) -> None:
    """vLLM's case: the API server dies alone (OOM killer, crash); its workers live on."""
    proc, pids, shm_name = launch_tree("worker,stubborn,escaped")
    proc.pids()  # the harness has seen the tree (samplers do this all the time)
    proc.kill_hard()
    assert not proc.alive()
    orphans = {role: pid for role, pid in pids.items() if role != "top"}
    assert all(alive(pid) for pid in orphans.values()), "killing the top process orphans the rest"

    report = proc.stop(grace_s=1.0)

    for role, pid in orphans.items():
        assert gone(pid), f"orphan {role} ({pid}) survived stop()"
    assert report.exit_code == -9
    assert report.forced_kill
    assert [p.split(":")[0] for p in report.leftover_processes] == [str(pids["escaped"])]
    assert shm_name in report.leftover_shm
    assert not (SHM_DIR / shm_name).exists()


def test_orphans_in_the_group_are_found_even_if_never_seen(launch_tree: Launcher) -> None:
    """The workers were forked after the harness last looked: the process group finds them."""
    proc, pids, shm_name = launch_tree("worker,worker")
    proc.kill_hard()
    report = proc.stop(grace_s=3.0)
    assert all(gone(pid) for pid in pids.values())
    assert not report.forced_kill  # SIGTERM to the group was enough
    assert shm_name in report.leftover_shm, "the orphans' segment is a leftover of the engine"
    assert not (SHM_DIR / shm_name).exists()


def _sleeper_watching_test_shm(tmp_path: Path) -> EngineProcess:
    """A process that holds nothing, watching this test's /dev/shm names as its own patterns."""
    return EngineProcess(
        "fake-server",
        [sys.executable, "-c", "import time; time.sleep(30)"],
        tmp_path / "s.log",
        shm_patterns=[f"{SHM_PREFIX}{os.getpid()}-*"],
    )


def test_another_engines_file_that_goes_away_is_not_a_leftover(tmp_path: Path) -> None:
    """Another engine's segment appears meanwhile and is unlinked by its own tracker a moment
    after this tree stopped: not this tree's leftover, and not deleted by us. A file that
    stays is one."""
    passing = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-passing-{uuid.uuid4().hex[:8]}"
    staying = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-staying-{uuid.uuid4().hex[:8]}"
    proc = _sleeper_watching_test_shm(tmp_path)
    try:
        passing.write_bytes(b"x" * 4096)
        staying.write_bytes(b"y" * 4096)
        timer = threading.Timer(0.5, passing.unlink)
        timer.start()
        report = proc.stop(grace_s=2.0)
        timer.join()
    finally:
        proc.stop(grace_s=1)
        passing.unlink(missing_ok=True)
        staying.unlink(missing_ok=True)
    assert report.leftover_shm == {staying.name: 4096}


def test_a_file_another_runs_engine_held_is_not_a_leftover(tmp_path: Path) -> None:
    """Another run's engine (here: a claim under this test's parent's pid) held a segment that
    outlives this tree's teardown: not counted here, and left for its owner to remove."""
    theirs = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-theirs-{uuid.uuid4().hex[:8]}"
    claim = SHM_CLAIMS_DIR / f"{os.getppid()}-{uuid.uuid4().int % 10**6}"
    proc = _sleeper_watching_test_shm(tmp_path)
    try:
        theirs.write_bytes(b"z" * 4096)
        SHM_CLAIMS_DIR.mkdir(exist_ok=True)
        claim.write_text(theirs.name)
        report = proc.stop(grace_s=2.0)
        assert theirs.exists()
    finally:
        proc.stop(grace_s=1)
        theirs.unlink(missing_ok=True)
        claim.unlink(missing_ok=True)
    assert report.leftover_shm == {}


def test_wait_until_ready_fails_fast_when_the_process_dies(tmp_path: Path) -> None:
    code = "import sys; print('loading weights'); sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)"
    proc = EngineProcess("fake-server", [sys.executable, "-c", code], tmp_path / "server.log")
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineStartError) as err:
            wait_until_ready(proc, "fakeeng", lambda: False, timeout_s=60)
        assert time.monotonic() - t0 < 10
    finally:
        proc.stop(grace_s=1)
    message = str(err.value)
    assert err.value.engine == "fakeeng"
    assert "exited with code 3 before health" in message
    assert "CUDA out of memory" in message and "loading weights" in message


def test_wait_until_ready_times_out_and_stops_the_process(tmp_path: Path) -> None:
    code = "import time; print('still compiling kernels', flush=True); time.sleep(60)"
    proc = EngineProcess("fake-server", [sys.executable, "-c", code], tmp_path / "server.log")
    pid = proc.pid

    def refused() -> bool:
        raise ConnectionRefusedError("nobody listens yet")

    try:
        t0 = time.monotonic()
        with pytest.raises(EngineStartError) as err:
            wait_until_ready(proc, "fakeeng", refused, timeout_s=1.0, what="/v1/models")
        assert time.monotonic() - t0 < 8
        assert gone(pid)
        assert proc.teardown_report is not None
    finally:
        proc.stop(grace_s=1)
    assert "not ready (/v1/models) after 1s" in str(err.value)
    assert "still compiling kernels" in err.value.log_tail


def test_wait_until_ready_returns_the_wait(tmp_path: Path) -> None:
    proc = EngineProcess(
        "fake-server", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log"
    )
    calls = iter([False, False, True])
    try:
        waited = wait_until_ready(proc, "fakeeng", lambda: next(calls), timeout_s=10)
        assert 0.4 <= waited < 5
        assert proc.alive()
    finally:
        assert proc.stop(grace_s=2).clean


def test_free_port_distinct_across_threads() -> None:
    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: free_port(), range(64)))
    assert len(set(ports)) == len(ports)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 16) * 2000
    assert all(low <= p < low + 2000 for p in ports)


CHILD = """
import sys
from kvconform.processes import free_port
print(" ".join(str(free_port()) for _ in range(int(sys.argv[1]))), flush=True)
sys.stdin.read()  # hold the reservations until the test has compared them
"""


def test_free_port_distinct_across_processes() -> None:
    """Three processes drawing from the same range hold their ports at the same time: no port
    is handed out twice (300 of 2000 each would collide without the reservations)."""
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw5"}
    root = REPO
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, "300"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        for _ in range(3)
    ]
    try:
        drawn = [[int(p) for p in child.stdout.readline().split()] for child in children]  # type: ignore[union-attr]
    finally:
        for child in children:
            child.communicate(timeout=10)
    ports = [p for batch in drawn for p in batch]
    assert len(ports) == 900
    assert len(set(ports)) == len(ports)
    assert all(30000 <= p < 32000 for p in ports)  # gw5's range


def test_engine_hashes_with_its_own_seed_not_the_runners(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    code = "import os; print('seed', os.environ.get('PYTHONHASHSEED'))"
    inherited = EngineProcess("seedless", [sys.executable, "-c", code], tmp_path / "a.log")
    given = EngineProcess(
        "seeded", [sys.executable, "-c", code], tmp_path / "b.log", env={"PYTHONHASHSEED": "3"}
    )
    for proc in (inherited, given):
        proc.popen.wait(timeout=30)
        proc.stop(grace_s=1)
    assert "seed None" in (tmp_path / "a.log").read_text()
    assert "seed 3" in (tmp_path / "b.log").read_text()


# A top process that, on SIGTERM, tells its child with SIGUSR1 a second later and waits for it (an
# engine's own shutdown); the child writes down the first signal that reached it.
TOP_STOPS_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def note(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGUSR1, note)
while True:
    time.sleep(0.05)
''', sys.argv[1]])
def shutdown(signum, frame):
    time.sleep(1.0)  # a group's SIGTERM reaches the child first
    child.send_signal(signal.SIGUSR1)
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, shutdown)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize(("whole_group", "child_saw"), [(True, "SIGTERM"), (False, "SIGUSR1")])
def test_stop_signals_the_top_alone_when_asked(tmp_path: Path, whole_group: bool, child_saw: str) -> None:
    """stop_whole_group=False leaves the children to the top process's own shutdown."""
    note = tmp_path / "child-signal"
    proc = EngineProcess(
        "top-stops-child",
        [sys.executable, "-c", TOP_STOPS_CHILD, str(note)],
        tmp_path / "log",
        stop_whole_group=whole_group,
    )
    deadline = time.monotonic() + 10
    while len(proc.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the child's handlers are installed
    report = proc.stop(grace_s=10)
    assert note.read_text() == child_saw
    assert report.clean and not report.forced_kill, report.describe()


def test_a_child_session_past_its_timeout_is_asked_to_stop_first(tmp_path: Path) -> None:
    """SIGTERM first (a kvconform session tears its engines down on it), SIGKILL after the grace."""
    marker = tmp_path / "stopped"
    graceful = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marker)!r}).touch(), sys.exit(2)))\n"
        "print('up', flush=True); time.sleep(60)"
    )
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        assert run_child_session([sys.executable, "-c", graceful], log, timeout_s=2.0, grace_s=20.0) is None
    assert marker.exists(), "the child was not sent SIGTERM"
    assert time.monotonic() - t0 < 15, "the child ended on SIGTERM; no wait for the grace"
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    t0 = time.monotonic()
    assert run_child_session([sys.executable, "-c", stubborn], None, timeout_s=1.0, grace_s=1.0) is None
    assert time.monotonic() - t0 < 15, "a child ignoring SIGTERM is killed after the grace"


def tail_once_done(proc: EngineProcess, lines: int = 40) -> list[str]:
    """The log tail of a short-lived process, read once it has exited (then stopped)."""
    try:
        deadline = time.monotonic() + 10
        while proc.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return proc.log_tail(lines).splitlines()
    finally:
        proc.stop(grace_s=1)


def test_a_log_tail_leads_with_the_error_line_its_traceback_pushed_out(tmp_path: Path) -> None:
    code = (
        "print('serving'); print('(EngineCore) ERROR Worker proc died unexpectedly (exit code: -4)'); "
        "[print(f'ERROR traceback line {i}') for i in range(60)]"
    )
    proc = EngineProcess("fake-server", [sys.executable, "-c", code], tmp_path / "server.log")
    tail = tail_once_done(proc)
    first = "[first error line before the tail] (EngineCore) ERROR Worker proc died unexpectedly"
    assert tail[0] == f"{first} (exit code: -4)"
    assert tail[-1] == "ERROR traceback line 59" and len(tail) == 42
    assert "serving" not in "\n".join(tail)


def test_a_log_tail_leads_with_this_launchs_death_line_however_far_up(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("Worker proc VllmWorker-0 died unexpectedly (an earlier launch)\n")
    code = (
        "print('serving'); print('Worker proc VllmWorker-0 died unexpectedly (exit code: None)'); "
        "[print(f'ERROR traceback line {i}') for i in range(400)]"
    )
    proc = EngineProcess("fake-server", [sys.executable, "-c", code], log, death_lines=("died unexpectedly",))
    tail = tail_once_done(proc)
    assert (
        tail[0]
        == "[a process of the engine died] Worker proc VllmWorker-0 died unexpectedly (exit code: None)"
    )
    assert tail[1].startswith("[first error line before the tail] ERROR traceback line 160")
