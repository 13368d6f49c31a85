"""./build.sh's channel swap and what a killed build leaves, without running rattler-build:

- the swap, killed before each of its filesystem steps, never leaves an instant without a
  complete channel, in both layouts (a directory exchanged in one step; a symlink flipped);
- a build interrupted by SIGTERM leaves no process of its group running and says what it
  left; a driver killed by SIGKILL takes its build's process group with it (PDEATHSIG);
- the next start removes what a killed build left and says so.
The build tool is the real worker (worker.py) with a stand-in for rattler-build that
starts a sleeping child, as a build script starts a compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sourcetree import copy_tree

from sm7x_tools import channel as channel_mod
from sm7x_tools.channel import STAMP, SUBDIRS, is_channel, lifecycle, read_stamp, replace_dir


def make_channel(path: Path, stamp: str) -> Path:
    for sub in SUBDIRS:
        (path / sub).mkdir(parents=True)
        (path / sub / "repodata.json").write_text(json.dumps({"info": {"subdir": sub}, "packages.conda": {}}))
    (path / STAMP).write_text(stamp + "\n")
    return path


def complete(target: Path) -> bool:
    return is_channel(target) and all((target / s / "repodata.json").is_file() for s in SUBDIRS) \
        and read_stamp(target) in ("old", "new")


class Killed(BaseException):
    pass


@pytest.fixture(params=["exchange", "symlink"])
def layout(request, monkeypatch):
    if request.param == "symlink":  # a filesystem without RENAME_EXCHANGE (NFS)
        monkeypatch.setattr(channel_mod, "exchange_supported", lambda d: False)
    return request.param


def test_swap_is_complete_at_every_instant_even_when_killed(tmp_path, layout, monkeypatch):
    """Kill the swap before its k-th step, for every k: the channel is complete before and
    after every step, and the next start's cleanup leaves exactly the new or the old one."""
    real = {"rename": os.rename, "symlink": os.symlink, "rmtree": shutil.rmtree, "exchange": channel_mod.exchange}
    state = {"left": None, "steps": 0}

    def step(name):
        def do(*args, **kw):
            assert complete(state["target"]), f"no complete channel before {name}{args}"
            if state["left"] == 0:
                raise Killed(name)
            if state["left"] is not None:
                state["left"] -= 1
            state["steps"] += 1
            real[name](*args, **kw)
            assert complete(state["target"]), f"no complete channel after {name}{args}"
        return do

    k = 0
    while True:
        root = tmp_path / f"k{k}"
        target = root / "channel"
        root.mkdir()
        replace_dir(make_channel(root / "first", "old"), target, versioned=True)  # the existing channel
        assert target.is_symlink() == (layout == "symlink")
        state.update(target=target, left=k, steps=0)
        with monkeypatch.context() as m:
            for name in ("rename", "symlink"):
                m.setattr(os, name, step(name))
            m.setattr(shutil, "rmtree", step("rmtree"))
            m.setattr(channel_mod, "exchange", step("exchange"))
            try:
                replace_dir(make_channel(root / "channel.partial", "new"), target, versioned=True)
                finished = True
            except Killed:
                finished = False
        assert complete(target)
        said = []
        lifecycle.clean_leftovers([], [target], root / "group.json", said.append)
        assert complete(target) and lifecycle.leftovers([], [target]) == []
        expected = {"channel"} | ({target.resolve().name} if layout == "symlink" else set())
        assert {p.name for p in root.iterdir()} == expected
        if finished:
            assert read_stamp(target) == "new" and not said
            break
        k += 1
    assert k >= 1, "the swap took no step that could be interrupted"


def test_exchange_keeps_channel_a_directory(tmp_path):
    """Where the filesystem can exchange (here), ./channel stays a plain directory: cp -r,
    rsync and web servers see what they always saw."""
    if not channel_mod.exchange_supported(tmp_path):
        pytest.skip("this filesystem cannot exchange directories")
    target = tmp_path / "channel"
    for stamp in ("a", "b", "c"):
        replace_dir(make_channel(tmp_path / "channel.partial", stamp), target, versioned=True)
        shutil.rmtree(tmp_path / "channel.partial", ignore_errors=True)
        assert target.is_dir() and not target.is_symlink() and read_stamp(target) == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["channel"]


# --- a build interrupted or killed ------------------------------------------------------------

FAKE_BUILD = """
import os, subprocess, sys, time
from pathlib import Path
from sm7x_tools.channel import rattler_build, worker

def build_here(recipe, *, output_dir, logfile, **kw):
    (output_dir / "noarch").mkdir(parents=True, exist_ok=True)
    (output_dir / "noarch" / "half-built.conda").write_bytes(b"x" * 1000)
    child = subprocess.Popen(["sleep", "300"])  # what a build script's compiler is
    Path(os.environ["PIDS"]).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(300)

rattler_build.build_here = build_here
worker.main(sys.argv[1])
"""

DRIVER = """
import sys
from sm7x_tools.channel import rattler_build, __main__ as build
rattler_build.worker_argv = lambda spec: [sys.executable, "-c", {fake!r}, str(spec)]
sys.exit(build.main(sys.argv[1:]))
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def tree(tmp_path):
    return copy_tree(tmp_path / "tree")


def start_build(tree: Path, out: Path, pids: Path, *args) -> subprocess.Popen:
    """The real ./build.sh driver, against a channel URL (no bootstrap), with the stand-in build.
    Its output goes to a file (proc.log): a pipe would stay open while any of the group runs."""
    log = open(pids.with_name("driver.log"), "w")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER.format(fake=FAKE_BUILD), "--channel", "file:///nowhere",
                             "--output", str(out), "--no-test", *args], cwd=tree, text=True,
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(tree / "python"), "PIDS": str(pids), "COLUMNS": "200"})
    proc.log = Path(log.name)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    proc.wait(timeout=timeout)
    return " ".join(proc.log.read_text().split())


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert proc.poll() is None, proc.log.read_text()
        assert time.monotonic() < deadline, "the stand-in build never started"
        time.sleep(0.1)
    return [int(p) for p in path.read_text().split()]


def kill_left(pids: list[int]) -> None:
    """SIGKILL whatever of pids still runs (a failed test must not leave builds behind)."""
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)


def gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_build_ends_its_group_and_says_what_was_left(tree, tmp_path, sig):
    out = make_channel(tmp_path / "channel", "old")
    proc = start_build(tree, out, tmp_path / "pids")
    pids = wait_for(tmp_path / "pids", proc)
    proc.send_signal(sig)
    text = finish(proc)
    try:
        assert proc.returncode == 128 + sig, text
        # the driver ends its group before it exits (not left to the worker's PDEATHSIG)
        assert gone(pids, timeout=0), f"still running when the driver exited: {[p for p in pids if alive(p)]}"
        assert f"interrupted ({signal.Signals(sig).name}):" in text
        assert f"{out} unchanged" in text and "partial output removed" in text, text
        assert read_stamp(out) == "old" and complete(out)
        assert not (tree / ".sm7x" / "build" / "work").exists() and not (tmp_path / "channel.partial").exists()
        assert {p.name for p in (tree / ".sm7x" / "build").iterdir()} <= {"build.log"}  # the log stays on purpose
    finally:
        kill_left(pids)


def test_killed_driver_takes_its_build_along_and_the_next_start_cleans(tree, tmp_path):
    out = make_channel(tmp_path / "channel", "old")
    proc = start_build(tree, out, tmp_path / "pids")
    pids = wait_for(tmp_path / "pids", proc)
    try:
        proc.kill()  # SIGKILL: no handler, no finally
        finish(proc)
        assert gone(pids), f"still running after SIGKILL of the driver: {[p for p in pids if alive(p)]}"
        work = tree / ".sm7x" / "build" / "work"
        assert (work / "noarch" / "half-built.conda").exists() and read_stamp(out) == "old"
        # what the kernel's message did not reach would still run; the next start ends it too
        (tmp_path / "channel.partial" / "noarch").mkdir(parents=True)
        stray = subprocess.Popen(["sleep", "300"], process_group=0, env={**os.environ, lifecycle.TOKEN_ENV: "t0"})
        pids.append(stray.pid)
        (tree / ".sm7x" / "build" / "group.json").write_text(json.dumps({"pgid": stray.pid, "token": "t0"}))
        nxt = subprocess.run([sys.executable, "-m", "sm7x_tools.channel", "--variants", "nonexistent",
                              "--output", str(out)], cwd=tree, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(tree / "python"), "COLUMNS": "300"})
        stray.wait(timeout=10)
        text = " ".join(nxt.stdout.split())
        assert "an earlier build was killed before it could clean up" in text, text
        assert "ended 1 process(es)" in text and str(work) in text and f"{tmp_path / 'channel.partial'}" in text
        assert not work.exists() and not (tmp_path / "channel.partial").exists() and complete(out)
        assert nxt.returncode == 1 and "unknown variant file" in text  # and then it went on as usual
    finally:
        kill_left(pids)


def test_a_second_build_of_the_tree_is_refused_while_one_runs(tree, tmp_path):
    out = make_channel(tmp_path / "channel", "old")
    proc = start_build(tree, out, tmp_path / "pids")
    pids = wait_for(tmp_path / "pids", proc)
    try:
        second = subprocess.run([sys.executable, "-m", "sm7x_tools.channel", "--output", str(out)], cwd=tree,
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": str(tree / "python"), "COLUMNS": "300"})
        text = " ".join(second.stdout.split())
        assert second.returncode == 1 and f"another build of this tree is running (pid {proc.pid}" in text, text
        assert (tree / ".sm7x" / "build" / "work").exists()  # the running build's work tree was not touched
    finally:
        proc.terminate()
        finish(proc)
        assert gone(pids)


def test_build_end_reaches_processes_in_groups_of_their_own(tmp_path):
    """ninja starts each compiler in a process group of its own: a signal to the build's
    group never reaches it. The build's token in their environment does."""
    pidfile = tmp_path / "pid"
    child = (f"import subprocess, sys; p = subprocess.Popen(['sleep', '300'], "
             f"start_new_session=True); open({str(pidfile)!r}, 'w').write(str(p.pid))")
    assert lifecycle.run_group([sys.executable, "-c", child], tmp_path / "group.json") == 0
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break  # gone (reaped by init)
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("a process of the build in a group of its own outlived the build")
