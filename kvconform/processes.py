"""Process ownership: every engine process runs in its own process group on 127.0.0.1.

Teardown signals the whole group, then verifies that no process of the tree and no /dev/shm
file the tree held is left; leftovers are killed/removed and reported, never ignored. vLLM's
API server, killed alone, orphans EngineCore and Worker processes (ENGINES.md), so signalling
one pid is never enough.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from kvconform.errors import EngineStartError
from kvconform.memory import shm_held_by

SHM_DIR = Path("/dev/shm")
# An engine's error line, as its logger writes it (vLLM, SGLang and LMCache log "ERROR"; Python
# starts a traceback so), looked for in the lines just above a log tail.
ERROR_LINE = re.compile(r"\bERROR\b|^Traceback \(most recent call last\)")
ERROR_LOOKBACK_LINES = 200
TAIL_SCAN_BYTES = 64_000  # of the log, for its tail and the error line above it
DEATH_SCAN_BYTES = 4_000_000  # of this launch's log, for the engine's last death line
# How long a /dev/shm file no process of this tree was seen holding may take to go away on its
# own before it counts as this tree's leftover (a resource tracker unlinks within ~0.1 s).
SHM_SETTLE_S = 3.0
# Between SIGTERM and SIGKILL: what a Kubernetes pod gets by default (terminationGracePeriodSeconds),
# so a stop is judged as a deployment stops it, not by a budget a loaded runner overruns.
STOP_GRACE_S = 30.0
_LIVE: set[EngineProcess] = set()
_LIVE_LOCK = threading.Lock()
_PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "kvconform-ports"
# What each engine tree of this machine's kvconform runs was seen holding in /dev/shm, one file
# per tree ("<harness pid>-<engine pid>"), so a teardown never counts another run's files.
SHM_CLAIMS_DIR = Path(tempfile.gettempdir()) / "kvconform-shm-claims"
_held_port_locks: dict[int, int] = {}


def free_port() -> int:
    """A loopback port nobody else in this machine's kvconform runs has reserved.

    Ports come from a range chosen per pytest-xdist worker and are reserved with a lock file
    held for the life of this process, so parallel workers and parallel sessions never race
    for the same port between "found free" and "engine bound it".
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 16) * 2000
    _PORT_LOCK_DIR.mkdir(exist_ok=True)
    for _ in range(500):
        port = random.randint(low, low + 1999)
        if port in _held_port_locks:
            continue
        fd = os.open(_PORT_LOCK_DIR / str(port), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                os.close(fd)
                continue
        _held_port_locks[port] = fd
        return port
    raise RuntimeError("no free loopback port found in 500 tries")


def _set_parent_death_signal() -> None:
    # If the suite process dies without teardown (SIGKILL, OOM), the engine's top process
    # gets SIGTERM instead of living on as an orphan.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class TeardownReport:
    """What teardown found. Leftovers were cleaned up; they are reported because they are
    the engine's fault (a leak), not because they are still there."""

    name: str
    exit_code: int | None
    seconds: float
    forced_kill: bool
    leftover_processes: list[str] = field(default_factory=list)
    leftover_shm: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the engine's own log said of its stop

    @property
    def clean(self) -> bool:
        return not self.leftover_processes and not self.leftover_shm

    def describe(self) -> str:
        parts = [f"{self.name}: exit {self.exit_code} after {self.seconds:.1f}s"]
        if self.forced_kill:
            parts.append("needed SIGKILL")
        if self.leftover_processes:
            parts.append(f"left processes {self.leftover_processes}")
        if self.leftover_shm:
            parts.append(f"left /dev/shm files {self.leftover_shm}")
        return "; ".join(parts + self.notes)


class EngineProcess:
    """One launched command: its own session and process group, output to a log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdin_pipe: bool = False,
        stdout_pipe: bool = False,
        shm_patterns: Iterable[str] = (),
        stop_whole_group: bool = True,
        death_lines: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.shm_patterns = tuple(shm_patterns)
        # False: stop() signals the top process alone and lets it shut its children down (its
        # own stop path), then the group only if the grace runs out. A signal to every process
        # at once can kill a child before it cleans up (SGLang: a named semaphore left each stop).
        self.stop_whole_group = stop_whole_group
        # What the engine logs when one of its own processes dies (its supervisor's line): the
        # last such line of this launch leads a log tail, however far up a traceback pushed it.
        self.death_lines = tuple(death_lines)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log_start = self._log.tell()  # the log is appended to across launches
        full_env = {**os.environ, **(env or {})}
        if "PYTHONHASHSEED" not in (env or {}):
            # An engine hashes as it does by default: a seed the suite's own runner exported (tox
            # does) would be shared by every engine process and hide per-process hash seeds.
            full_env.pop("PYTHONHASHSEED", None)
        hook = os.environ.get("KVCONFORM_MUTANT_HOOK")
        if hook:  # a mutant run (kvconform.mutants): an adapter's own PYTHONPATH must not drop the hook
            parts = [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p and p != hook]
            full_env["PYTHONPATH"] = os.pathsep.join([hook, *parts])
        # A temp dir of its own unless the adapter gave one: engines leave ipc:// sockets and
        # scratch files in $TMPDIR when killed (vLLM: one socket per launch, named by uuid).
        self._own_tmpdir: str | None = None
        if not (env or {}).get("TMPDIR"):
            self._own_tmpdir = tempfile.mkdtemp(prefix=f"kvc-{name}-")
            full_env["TMPDIR"] = self._own_tmpdir
        self.started_at = time.time()
        self._shm_before = _shm_listing(self.shm_patterns)
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_set_parent_death_signal,
        )
        self.pgid = self.popen.pid
        self._known: dict[int, float] = {}
        self._held_shm: set[str] = set()
        self.teardown_report: TeardownReport | None = None
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.refresh_tree()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` of the log; where an error line precedes them closely (a crash
        whose traceback fills the tail), the earliest such line first: what died, and why."""
        try:
            if not self._log.closed:  # stop() closes it; the tail is still on disk
                self._log.flush()
            with open(self.log_path, "rb") as log:
                end = log.seek(0, os.SEEK_END)
                start = max(0, end - (DEATH_SCAN_BYTES if self.death_lines else TAIL_SCAN_BYTES))
                log.seek(start)
                data = log.read()
        except OSError:
            return ""
        text = data[-TAIL_SCAN_BYTES:].decode("utf-8", "replace").splitlines()
        tail, before = text[-lines:], text[:-lines][-ERROR_LOOKBACK_LINES:]
        lead = []
        death = None
        if self.death_lines:  # the last one of this launch (the log is appended to across launches)
            this_launch = data[max(0, self._log_start - start) :].decode("utf-8", "replace").splitlines()
            death = next((ln for ln in reversed(this_launch) if any(d in ln for d in self.death_lines)), None)
        if death is not None and death not in tail:
            lead.append(f"[a process of the engine died] {death}")
        first_error = next((line for line in before if ERROR_LINE.search(line)), None)
        if first_error is not None and first_error != death:
            lead.append(f"[first error line before the tail] {first_error}")
        return "\n".join([*lead, "[...]", *tail] if lead else tail)

    def refresh_tree(self) -> list[psutil.Process]:
        """Every live process of this engine: the group, plus descendants that left it."""
        procs: dict[int, psutil.Process] = {}
        for proc in _group_members(self.pgid):
            procs[proc.pid] = proc
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            procs[root.pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                self._known.setdefault(proc.pid, proc.create_time())
        held = set(shm_held_by(procs))
        if not held <= self._held_shm:
            self._held_shm |= held
            self._publish_claim()
        return list(procs.values())

    @property
    def _claim_path(self) -> Path:
        return SHM_CLAIMS_DIR / f"{os.getpid()}-{self.pid}"

    def _publish_claim(self) -> None:
        with contextlib.suppress(OSError):
            SHM_CLAIMS_DIR.mkdir(exist_ok=True)
            staged = self._claim_path.with_suffix(".staged")
            staged.write_text("\n".join(sorted(self._held_shm)))
            os.replace(staged, self._claim_path)

    def _claimed_by_others(self) -> set[str]:
        names: set[str] = set()
        for path in SHM_CLAIMS_DIR.glob("*-*"):
            if path == self._claim_path or path.suffix:
                continue
            harness = path.name.split("-", 1)[0]
            if not harness.isdigit() or not psutil.pid_exists(int(harness)):
                path.unlink(missing_ok=True)  # a run that died without its teardown
                continue
            with contextlib.suppress(OSError):
                names |= set(path.read_text().split())
        return names

    def pids(self) -> list[int]:
        return [p.pid for p in self.refresh_tree()]

    def held_shm(self) -> set[str]:
        return set(self._held_shm)

    def stop(self, grace_s: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> TeardownReport:
        if self.teardown_report is not None:
            return self.teardown_report
        self.refresh_tree()
        t0 = time.monotonic()
        forced = False
        with contextlib.suppress(ProcessLookupError):
            if self.stop_whole_group:
                os.killpg(self.pgid, sig)
            else:
                os.kill(self.pid, sig)
        # A stopped (SIGSTOPped, hung in a debugger) tree only acts on the signal once it runs
        # again: continue it, or teardown waits the whole grace period for nothing.
        self._continue_all()
        escaped: list[str] = []
        if not self._wait_gone(grace_s):
            forced = True
            # Processes that left the group (setsid) never got the group's signal: the engine
            # left them behind, so they are leftovers even though the SIGKILL below ends them.
            escaped = [f"{p.pid}:{_safe_name(p)}" for p in self._survivors() if _pgid(p.pid) != self.pgid]
            self._kill_all()
            self._wait_gone(5.0)
        exit_code = self.popen.poll()
        report = TeardownReport(self.name, exit_code, time.monotonic() - t0, forced)
        remaining = [f"{p.pid}:{_safe_name(p)}" for p in self._survivors()]
        report.leftover_processes = escaped + [p for p in remaining if p not in escaped]
        if report.leftover_processes:
            self._kill_all()
            self._wait_gone(5.0)
        report.leftover_shm = self._leftover_shm(
            {int(entry.split(":", 1)[0]) for entry in report.leftover_processes}
        )
        for name in report.leftover_shm:
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
        self._claim_path.unlink(missing_ok=True)
        self._log.close()
        if self._own_tmpdir is not None:
            shutil.rmtree(self._own_tmpdir, ignore_errors=True)
        self.teardown_report = report
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return report

    def kill_hard(self) -> None:
        """SIGKILL the top process only, the way an OOM killer or a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def _survivors(self) -> list[psutil.Process]:
        alive = []
        for pid, created in self._known.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) < 0.01 and proc.status() != "zombie":
                    alive.append(proc)
            except psutil.Error:
                continue
        alive.extend(p for p in _group_members(self.pgid) if p.pid not in self._known)
        return alive

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=0.1)
            if self.popen.poll() is not None and not self._survivors():
                return True
            time.sleep(0.1)
        return False

    def _continue_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGCONT)
        for proc in self._survivors():
            if _pgid(proc.pid) != self.pgid:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGCONT)

    def _kill_all(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        for proc in self._survivors():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def _leftover_shm(self, leftover_pids: set[int]) -> dict[str, int]:
        # Files this tree was seen holding are its own. Files that only appeared meanwhile
        # (matching its patterns, held by no one) may be another engine's on this machine, in
        # the gap between its last process unmapping them and its resource tracker unlinking
        # them: a run whose tree ever held one claimed it; the rest must stay a moment to count.
        unattributed = set(_shm_listing(self.shm_patterns)) - set(self._shm_before) - self._held_shm
        unattributed -= self._claimed_by_others()
        candidates = (self._held_shm | unattributed) - self._held_by_others(leftover_pids)
        if pending := candidates & unattributed:
            deadline = time.monotonic() + SHM_SETTLE_S
            while time.monotonic() < deadline and any((SHM_DIR / n).exists() for n in pending):
                time.sleep(0.1)
            candidates -= self._held_by_others(leftover_pids)
        left = {}
        for name in sorted(candidates):
            with contextlib.suppress(OSError):
                left[name] = (SHM_DIR / name).stat().st_size
        return left

    def _held_by_others(self, leftover_pids: set[int]) -> set[str]:
        # A file another live process still holds is not this tree's leftover: an LMCache
        # server maps segments its clients created, and a vLLM server another session is
        # starting on this machine owns the psm_* ring created meanwhile. Deleting those would
        # break an engine that is not ours (seen: concurrent vLLM starts failing to attach).
        own = {self.pid, os.getpid(), *self._known, *leftover_pids}
        others = [proc.pid for proc in psutil.process_iter() if proc.pid not in own]
        return set(shm_held_by(others))


def wait_until_ready(
    process: EngineProcess,
    engine: str,
    probe: Callable[[], bool],
    timeout_s: float,
    what: str = "health",
) -> float:
    """Poll probe() until it returns True; fail fast if the process dies, with its log tail."""
    t0 = time.monotonic()
    while True:
        if not process.alive():
            code = process.popen.poll()
            tail = process.log_tail()
            why = f"{process.name} exited with code {code} before {what}"
            if "address already in use" in tail.lower():
                why += " (a port it was given was taken by another process: 'Address already in use')"
            process.stop(grace_s=5)  # audit what it left (its children, /dev/shm)
            raise EngineStartError(engine, why, tail)
        with contextlib.suppress(Exception):
            if probe():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            process.stop(grace_s=5)
            raise EngineStartError(
                engine, f"{process.name} not ready ({what}) after {timeout_s:.0f}s", process.log_tail()
            )
        time.sleep(0.25)


def stop_all_live() -> list[TeardownReport]:
    with _LIVE_LOCK:
        live = list(_LIVE)
    return [proc.stop(grace_s=5) for proc in live]


atexit.register(stop_all_live)


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != "zombie":
                members.append(proc)
    return members


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _shm_listing(patterns: tuple[str, ...]) -> dict[str, int]:
    listing = {}
    for pattern in patterns:
        for path in SHM_DIR.glob(pattern):
            with contextlib.suppress(OSError):
                listing[path.name] = path.stat().st_size
    return listing


def _safe_name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def sigterm_as_interrupt() -> None:
    """SIGTERM (a CI job's timeout, a runner's cancel) raises KeyboardInterrupt in the main
    thread, so the session tears down as on Ctrl-C: engines stopped and audited, results
    written. Left alone, SIGTERM ends Python without teardown and the engines, in sessions of
    their own, outlive it. A second SIGTERM ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # someone else's handler: theirs to keep

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


def run_child_session(
    argv: list[str],
    log: IO[str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 90.0,
    env: dict[str, str] | None = None,
) -> int | None:
    """A child kvconform session (pytest), its output to `log` (None: this process's). On
    timeout, or when this process is interrupted, the child gets SIGTERM (its plugin tears its
    session down) and SIGKILL only after `grace_s`; subprocess.run would SIGKILL it at once,
    orphaning its engines. Returns its exit code, None where it timed out."""
    stderr = subprocess.STDOUT if log is not None else None
    child = subprocess.Popen(argv, env=env, stdout=log, stderr=stderr)
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_child(child, grace_s)
        return None
    except KeyboardInterrupt:
        _end_child(child, grace_s)
        raise


def _end_child(child: subprocess.Popen[bytes], grace_s: float) -> None:
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
