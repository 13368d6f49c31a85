"""What a build may leave behind: nothing running, nothing half-written, and a clear word.

- The build tool (rattler-build, through worker.py) runs as the leader of its own process
  group; the group (build scripts, cmake, nvcc, cc1plus) is ended when the build returns,
  fails or is interrupted. Should the driver itself be killed (SIGKILL), the worker gets
  SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends its group; whatever still runs is
  ended by the next start, which finds the group in GROUP_FILE.
- One build at a time per source tree (an flock on STATE/build.lock): the next start may
  then remove what a killed build left (its work trees, CHANNEL.partial, unflipped
  versions of a symlinked channel) and says what it removed.
- SIGTERM, SIGINT and SIGHUP become `Interrupted` in the driver, so every `finally` runs
  (the group is ended, partial output removed) and main says what was left as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from . import BuildFailed, partial, versions

TOKEN_ENV = "SM7X_BUILD_TOKEN"  # inherited by every process of a build's group
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal asked the build to stop (BaseException: `except Exception` must not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interruptible():
    """SIGTERM/SIGINT/SIGHUP raise Interrupted in the main thread while inside."""
    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --- the build's process group ------------------------------------------------------------

def members(pgid: int, token: str | None = None) -> list[int]:
    """Live processes of the build (zombies excluded: they run nothing). With the build's
    token: every process whose environment carries it, in whatever process group (ninja
    starts each compiler in a group of its own, out of reach of a signal to the build's
    group); without: the processes of group `pgid`."""
    found = []
    mark = f"{TOKEN_ENV}={token}".encode() if token is not None else None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            if mark is None and int(fields[2]) != pgid:
                continue
            if mark is not None and mark not in (proc / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        found.append(int(proc.name))
    return found


def end_group(pgid: int, token: str | None = None, grace: float = 5.0) -> int:
    """SIGTERM the group, SIGKILL what is left after `grace` seconds; returns how many ran."""
    running = members(pgid, token)
    if not running:
        return 0
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for pid in members(pgid, token):  # those in groups of their own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while members(pgid, token) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not members(pgid, token):
            break
    return len(running)


def run_group(argv: list[str], group_file: Path, env: dict | None = None) -> int:
    """Run argv as the leader of a new process group and return its exit status; the whole
    group is ended however this returns (done, failed, Interrupted)."""
    token = uuid.uuid4().hex
    env = {**(env if env is not None else os.environ), TOKEN_ENV: token, "SM7X_BUILD_DRIVER": str(os.getpid())}
    proc = subprocess.Popen(argv, process_group=0, env=env)
    group_file.parent.mkdir(parents=True, exist_ok=True)
    group_file.write_text(json.dumps({"pgid": proc.pid, "token": token}) + "\n")
    try:
        return proc.wait()
    finally:
        end_group(proc.pid, token)
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        group_file.unlink(missing_ok=True)


# --- one build at a time, and what a killed one left --------------------------------------

@contextlib.contextmanager
def build_lock(lock: Path):
    """Held for the whole build; refuses a second build of the same tree while one runs."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            raise BuildFailed(f"another build of this tree is running (pid {pid}, lock {lock}); wait for it to "
                              f"finish or end it (kill {pid})") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


def leftovers(work_dirs: list[Path], outputs: list[Path]) -> list[Path]:
    """What a killed build leaves: work trees, CHANNEL.partial, CHANNEL.old (the former
    two-rename swap), and for a symlinked channel its pending link and unflipped versions."""
    found = [d for d in work_dirs if d.exists()]
    for out in outputs:
        found += [p for p in (partial(out), out.with_name(out.name + ".old"), out.with_name(f".{out.name}.link"))
                  if p.exists() or p.is_symlink()]
        current = out.resolve() if out.is_symlink() else None
        found += [v for v in versions(out) if v != current]
    return found


def clean_leftovers(work_dirs: list[Path], outputs: list[Path], group_file: Path, say) -> None:
    """Called at the start of a build, with the lock held: no other build owns any of this."""
    ended = 0
    if group_file.exists():
        with contextlib.suppress(ValueError, KeyError, OSError):
            group = json.loads(group_file.read_text())
            ended = end_group(int(group["pgid"]), str(group["token"]))
        group_file.unlink(missing_ok=True)
    removed = []
    for path in leftovers(work_dirs, outputs):
        size = _size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(f"{path} ({size / 1e6:.1f} MB)")
    if ended or removed:
        what = ([f"ended {ended} process(es) still running from it"] if ended else []) + \
               ([f"removed {', '.join(removed)}"] if removed else [])
        say(f"an earlier build was killed before it could clean up; cleaned what it left: {'; '.join(what)}")
