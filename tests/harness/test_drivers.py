"""The JSON-lines driver client against fake drivers (tests/fixtures/drivers/).

Every way a driver can go wrong (hang, crash, garbage on stdout; at start or during an op)
must become a DriverError/EngineStartError naming the engine, the op and the driver's log
tail, within the op's timeout, and leave no driver process running.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvconform.errors import DriverError, EngineError, EngineStartError
from kvconform.kit.drivers import DriverProcess
from tests.paths import FIXTURES

DRIVERS = FIXTURES / "drivers"
ENGINE = "fakeeng"


def driver_children() -> list[psutil.Process]:
    """Fake drivers still running under this test process."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and any(str(DRIVERS) in a for a in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def no_driver_left(within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while driver_children():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    assert not driver_children(), "a fake driver was already running before this test"
    yield
    left = driver_children()
    for proc in left:
        proc.kill()
    assert not left, f"fake drivers left running: {[p.pid for p in left]}"


def start(script: str, tmp_path: Path, at: str | None = None, timeout_s: float = 20.0) -> DriverProcess:
    return DriverProcess(
        ENGINE,
        Path(sys.executable),
        str(DRIVERS / script),  # absolute: replaces the adapters/drivers/ directory
        tmp_path / f"{script}.log",
        env={"FAKE_DRIVER_AT": at} if at else None,
        start_timeout_s=timeout_s,
    )


def assert_names(err: EngineError, op: str, tail_text: str) -> None:
    message = str(err)
    assert err.engine == ENGINE
    assert message.startswith(f"engine {ENGINE}: ")
    assert repr(op) in message
    assert tail_text in err.log_tail and tail_text in message


def test_good_driver_round_trip(tmp_path: Path) -> None:
    driver = start("good_driver.py", tmp_path)
    try:
        assert driver.version == "9.9.9"
        assert driver.call("add", a=2, b=3) == 5
        assert driver.call("echo", x=[1, 2], y="z") == {"x": [1, 2], "y": "z"}
        assert driver.process.pid in driver.pids()
        with pytest.raises(DriverError) as err:
            driver.call("fail", why="no blocks")
        assert "op 'fail' failed: ValueError: refused: no blocks" in str(err.value)
        assert "Traceback" in err.value.log_tail
        with pytest.raises(DriverError, match="unknown op 'nosuch'"):
            driver.call("nosuch")
        assert driver.call("add", a=1, b=1) == 2, "a failed op leaves the driver usable"
    finally:
        report = driver.close()
    # close() signals the group right after the shutdown reply, so the driver may still be
    # exiting on its own when SIGTERM arrives: 0 or -15, never a forced kill.
    assert report.exit_code in (0, -15) and not report.forced_kill and report.clean
    assert "engine chatter on stdout" in driver.log_tail()
    assert "good driver starting" in driver.log_tail()


def test_hang_on_op_times_out(tmp_path: Path) -> None:
    driver = start("hang_driver.py", tmp_path)
    try:
        assert driver.call("ping") == "pong"
        t0 = time.monotonic()
        with pytest.raises(DriverError) as err:
            driver.call("slow", timeout_s=1.0)
        assert time.monotonic() - t0 < 1.0 + 4.0
        assert_names(err.value, "slow", "waiting on a collective that never completes")
        assert "hung for 1s" in str(err.value)
        assert not driver.process.alive(), "a hung driver is stopped, not left running"
        with pytest.raises(DriverError, match="driver is not running"):
            driver.call("ping")
    finally:
        driver.close()


def test_hang_at_start_times_out(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(DriverError) as err:
        start("hang_driver.py", tmp_path, at="start", timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 5.0
    assert_names(err.value, "start", "loading weights forever")
    assert no_driver_left()


def test_crash_on_op(tmp_path: Path) -> None:
    driver = start("crash_driver.py", tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(DriverError) as err:
            driver.call("store", timeout_s=30)
        assert time.monotonic() - t0 < 5.0, "a dead driver is noticed at once, not after the timeout"
        assert_names(err.value, "store", "Segmentation fault in kv_store")
        assert "exited with code 11" in str(err.value)
    finally:
        report = driver.close()
    assert report.exit_code == 11


def test_crash_at_start(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(DriverError) as err:
        start("crash_driver.py", tmp_path, at="start", timeout_s=30)
    assert time.monotonic() - t0 < 5.0
    assert_names(err.value, "start", "Segmentation fault in kv_store")
    assert no_driver_left()


def test_garbage_on_op(tmp_path: Path) -> None:
    driver = start("garbage_driver.py", tmp_path)
    try:
        with pytest.raises(DriverError) as err:
            driver.call("stats", timeout_s=10)
        assert_names(err.value, "stats", "engine printed to stdout")
        assert "non-protocol line" in str(err.value) and "Loading checkpoint shards" in str(err.value)
    finally:
        driver.close()
    assert no_driver_left()


def test_garbage_at_start(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        start("garbage_driver.py", tmp_path, at="start", timeout_s=10)
    assert time.monotonic() - t0 < 5.0
    assert isinstance(err.value, DriverError | EngineStartError)
    assert_names(err.value, "start", "garbage driver starting")
    assert "Loading checkpoint shards" in str(err.value)
    assert no_driver_left(), "a driver that failed its start must not be left running"
