"""Running rattler-build through its Python API, with progress and readable errors.

rattler-build reports failures only through the progress callback's log, so every log
line goes to a file and the tail of it is shown when a build fails.

rattler-build runs in a worker process (worker.py) that leads its own process group, so
that the build scripts and compilers it starts end with the build however the build ends
(lifecycle.py); `build` is the driver's side, `build_here` the worker's.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import time
from pathlib import Path

from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

from .. import REPO, STATE
from ..ui import console
from . import BuildFailed, lifecycle

GROUP_FILE = STATE / "build" / "group.json"  # the running build's process group, for the next start


class _Progress:
    def __init__(self, logfile: Path, status):
        self.log = open(logfile, "a", encoding="utf-8")
        self.tail = collections.deque(maxlen=60)
        self.status = status

    def _line(self, text: str) -> None:
        self.log.write(text + "\n")
        self.tail.append(text)

    def on_download_start(self, event): pass
    def on_download_progress(self, event): pass
    def on_download_complete(self, event): pass

    def on_build_step(self, event):
        self._line(f"== {event.step_name}: {event.message}")

    def on_log(self, event):
        for text in str(event.message).splitlines():
            self._line(text)
            if text.startswith(("Starting build", "Artifact:", "Running test", "Compressing")):
                self.status.update(f"[bold]{text[:110]}")


def build_order(rendered: list) -> list:
    """One build per distinct output, noarch outputs last, each after those it depends on.

    rendered: a variant per (output, variant combination), so a noarch output comes back
    once per Python although all renderings are the same package (same hash). A noarch
    package's tests install it next to the packages it depends on (per-Python ones for
    the lowest and highest Python, the sm7x-fa2 selector), so those must exist first.
    """
    unique = {}
    for v in rendered:
        key = (v.recipe.package.name, str(v.hash_info.hash) if v.hash_info else repr(v.variant))
        unique.setdefault(key, v)
    deps = {v.recipe.package.name: {str(d).split()[0] for d in v.recipe.requirements.run}
            for v in unique.values()}

    def depth(name: str, seen: frozenset = frozenset()) -> int:
        inner = [depth(d, seen | {name}) for d in deps.get(name, ()) if d in deps and d not in seen]
        return 1 + max(inner, default=-1)

    return sorted(unique.values(), key=lambda v: (v.recipe.build.noarch is not None, depth(v.recipe.package.name)))


def worker_argv(spec: Path) -> list[str]:
    return [sys.executable, "-m", "sm7x_tools.channel.worker", str(spec)]


def build(recipe: Path, *, output_dir: Path, channels: list[str], variant_files: list[Path],
          logfile: Path, test: bool = True, outputs: list[str] | None = None,
          variant: dict[str, str] | None = None) -> None:
    """Build every variant of one recipe into output_dir (or those of `outputs` whose variant
    has the values in `variant`), in a worker process whose process group is ended with the
    build; raises BuildFailed with the worker's message."""
    spec, result = logfile.with_suffix(".spec.json"), logfile.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"recipe": str(recipe), "output_dir": str(output_dir), "channels": channels,
                                "variant_files": [str(f) for f in variant_files], "logfile": str(logfile),
                                "test": test, "result": str(result), "outputs": outputs, "variant": variant}))
    try:
        # the worker imports the tools from the source tree, then drops PYTHONPATH before building
        status = lifecycle.run_group(worker_argv(spec), GROUP_FILE,
                                     env={**os.environ, "PYTHONPATH": str(REPO / "python")})
        outcome = json.loads(result.read_text()) if result.exists() else {}
    except ValueError:
        outcome = {}
    finally:  # done, failed or interrupted
        spec.unlink(missing_ok=True)
        result.unlink(missing_ok=True)
    if status != 0 or not outcome.get("ok"):
        raise BuildFailed(outcome.get("error") or f"the build process for {recipe} ended with status {status} "
                                                  f"and no result; its log: {logfile}")


def package_cache() -> Path:
    """rattler's package cache (RATTLER_CACHE_DIR, which venv.sh sets; else rattler's default)."""
    root = os.environ.get("RATTLER_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rattler" / "cache"
    return Path(root) / "pkgs"


def evict_cached(packages: set[tuple[str, str]], cache: Path | None = None) -> list[str]:
    """Remove the extracted copies of (name, version) from rattler's package cache.

    The cache keys an extracted package by its file name. A rebuilt package keeps its name
    (the hash is of the variant, not of the content), and rattler then installed the stale
    copy into the build's own test environment: a test of sm7x-ext ran the previous build's
    module. Evicted before each build, so its tests (and later installs) read what it made.
    """
    cache = package_cache() if cache is None else cache
    removed = []
    if not cache.is_dir():
        return removed
    for entry in cache.iterdir():
        # name-version-build[.lock]: neither a version nor a build string holds a '-', so
        # a package whose name only starts alike (sm7x-fa2 vs sm7x-fa2-sm75) never matches
        parts = entry.name.removesuffix(".lock").rsplit("-", 2)
        if len(parts) == 3 and (parts[0], parts[1]) in packages:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    return sorted(removed)


def build_here(recipe: Path, *, output_dir: Path, channels: list[str], variant_files: list[Path],
               logfile: Path, test: bool = True, outputs: list[str] | None = None,
               variant: dict[str, str] | None = None) -> list:
    """Build every variant of one recipe (or the selected ones, as in `build`) into output_dir
    in this process (the worker's side); return rattler-build's results."""
    files = [str(f) for f in variant_files]
    local = recipe.parent / "variants.yaml"
    if local.exists():
        files.append(str(local))
    variants = VariantConfig.from_files(files) if files else VariantConfig()
    tool = ToolConfiguration(test_strategy="native" if test else "skip", compression_threads=2)
    chosen = [v for v in Stage0Recipe.from_file(recipe).render(variants)
              if (outputs is None or v.recipe.package.name in outputs)
              and all(str(v.variant.get(k)) == str(x) for k, x in (variant or {}).items())]
    if not chosen:
        raise BuildFailed(f"no variant of {recipe} is one of the outputs {outputs} with {variant}")
    evict_cached({(v.recipe.package.name, str(v.recipe.package.version)) for v in chosen})
    start = time.monotonic()
    with console.status(f"[bold]building {recipe.parent.name}") as status:
        progress = _Progress(logfile, status)
        results = []
        try:
            for v in build_order(chosen):
                t0 = time.monotonic()
                r = v.run_build(
                    tool_config=tool,
                    output_dir=output_dir,
                    channels=channels,
                    progress_callback=progress,
                    package_format="conda:1",  # several times faster than the default level
                )
                console.print(f"  [green]built[/] {r.name} {r.version} {r.build_string}  ({time.monotonic() - t0:.0f} s)")
                results.append(r)
        except Exception as exc:
            tail = "\n    ".join(list(progress.tail)[-30:])
            raise BuildFailed(f"rattler-build failed on {recipe}: {exc}\n  last log lines:\n    {tail}\n  full log: {logfile}") from exc
        finally:
            progress.log.close()
    console.print(f"  {recipe.parent.name}: {len(results)} package(s) in {time.monotonic() - start:.0f} s")
    return results
