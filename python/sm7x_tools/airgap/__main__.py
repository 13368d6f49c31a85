"""./airgap.sh: carry sm7x environments to clusters that cannot reach a channel.

    ./airgap.sh bundle OUT --env NAME=SPEC[,SPEC...] [--cuda-arch NAME=7.5] [--envs FILE.yaml]
                           [--channel DIR]... [--base-url URL] [--cuda 12.4] [--glibc 2.28] [--hardlink]
    ./airgap.sh verify DIR [--with DIR]... [--against SOURCE]... [--no-resolve]
    ./airgap.sh merge OUT CHANNEL CHANNEL... [--with DIR]... [--keep-first]

bundle  solve each environment for its target node (with --cuda-arch NAME=X.Y: a GPU node
        of that compute capability, CEP 46 __cuda_arch; without: a node with no GPU, which
        gets the fallback variants) and write OUT/channel (the packages, indexed),
        OUT/pixi.lock + OUT/pixi.toml, OUT/envs/NAME.txt (conda @EXPLICIT) and OUT/bundle.json.
        --envs FILE.yaml instead of --env:
            environments:
              t4-nodes: {specs: [sm7x, python 3.11.*], cuda_arch: "7.5"}
              login:    {specs: [sm7x, python 3.11.*]}
verify  check a bundle or any channel directory; exit 1 and a table of every problem.
merge   one indexed, verified channel from several (e.g. a CI matrix of --variants builds).

Exit status: 0 ok, 1 failed (the message says why and what to do), 2 wrong usage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from .. import ToolError, bootstrap
from ..channel import is_channel
from ..envs import channel_dirs, exit_now
from ..ui import console


def parse(argv):
    ap = argparse.ArgumentParser(prog="./airgap.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{bundle,verify,merge}")

    b = sub.add_parser("bundle", help="solve environments for target nodes and write a self-contained bundle")
    b.add_argument("out", type=Path, metavar="OUT", help="bundle directory to (re)write")
    b.add_argument("--env", action="append", default=[], metavar="NAME=SPEC[,SPEC...]",
                   help="an environment, e.g. t4-nodes=sm7x,python=3.11 (repeatable)")
    b.add_argument("--cuda-arch", action="append", default=[], metavar="NAME=X.Y",
                   help="the compute capability of NAME's nodes (minimum over their GPUs); absent: no GPU")
    b.add_argument("--envs", type=Path, metavar="FILE.yaml", help="environments from a YAML file (see above)")
    b.add_argument("--channel", action="append", type=Path, metavar="DIR",
                   help="source channel directory, in priority order (default: ./channel and the bootstrap channel)")
    b.add_argument("--base-url", metavar="URL",
                   help="URL where OUT/channel will be served (default: file://OUT/channel)")
    b.add_argument("--cuda", default="12.4", metavar="X.Y", help="__cuda (driver) version of GPU nodes (default 12.4)")
    b.add_argument("--glibc", metavar="X.Y", help="__glibc of the target nodes (default: this machine's)")
    b.add_argument("--hardlink", action="store_true",
                   help="hardlink packages from the source channels instead of copying")

    v = sub.add_parser("verify", help="check a bundle or a channel directory")
    v.add_argument("dir", type=Path, metavar="DIR")
    v.add_argument("--with", dest="with_", action="append", type=Path, metavar="DIR",
                   help="another channel that dependencies may come from (repeatable; default for a channel: "
                        "the bootstrap channel, as for merge; a bundle must hold all it needs)")
    v.add_argument("--no-resolve", action="store_true", help="bundles: skip the offline re-solve of each environment")
    v.add_argument("--against", action="append", default=[], type=Path, metavar="SOURCE",
                   help="the channel (or bundle) DIR was copied from: every package of it must be in DIR "
                        "with the same sha256 (catches a mirror altered and re-indexed)")

    m = sub.add_parser("merge", help="merge channels built on several machines into one")
    m.add_argument("out", type=Path, metavar="OUT")
    m.add_argument("channels", type=Path, nargs="+", metavar="CHANNEL")
    m.add_argument("--with", dest="with_", action="append", type=Path, metavar="DIR",
                   help="channel that dependencies may come from when verifying the result "
                        "(default: the bootstrap channel)")
    m.add_argument("--keep-first", action="store_true",
                   help="the explicit override: for a file name whose copies differ in payload (files, install "
                        "instructions) but agree in info/index.json, take the first channel's copy instead of "
                        "refusing; list the channel you trust first")
    return ap.parse_args(argv)


def default_with(given: list[Path] | None, bundle: bool = False) -> list[Path]:
    """--with as given, else the bootstrap channel: ./channel's packages depend on the toolchain
    packages there (python, pytorch), so a channel that ./build.sh or merge made verifies as
    it is. Never for a bundle, which must hold everything its environments need."""
    if given is not None:
        return given
    return [] if bundle else [c for c in [bootstrap.CHANNEL] if is_channel(c)]


def run(args) -> int:
    if args.command == "bundle":
        from .bundle import bundle, print_summary, requests_from_args

        reqs = requests_from_args(args.env, args.cuda_arch, args.envs)
        result = bundle(args.out, reqs, channel_dirs(args.channel), base_url=args.base_url,
                        cuda=args.cuda, glibc=args.glibc, hardlink=args.hardlink)
        print_summary(result)
        return 0
    if args.command == "verify":
        from .verify import print_report, verify

        with_ = default_with(args.with_, bundle=(args.dir / "bundle.json").exists())
        if args.with_ is None and with_:
            console.print("dependencies may also come from " + " and ".join(map(str, with_))
                          + " (the default --with for a channel; give --with DIR to choose)")
        report = verify(args.dir, with_, resolve=not args.no_resolve, against=args.against)
        print_report(report)
        return 0 if report.ok else 1
    from .merge import merge, print_summary

    with_ = default_with(args.with_)
    console.print("dependencies are checked against the merged channel"
                  + "".join(f" and {c}" for c in with_))
    print_summary(merge(args.out, args.channels, with_, keep_first=args.keep_first))
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        return run(args)
    except ToolError as exc:
        console.print(f"[bold red]{args.command} failed:[/] {escape(str(exc))}")
        if args.command != "verify":
            console.print("[red]nothing was written; an existing output was left as it was[/]")
        return 1
    except KeyboardInterrupt:
        console.print("[red]interrupted; an existing output was left as it was[/]")
        return 130


if __name__ == "__main__":
    exit_now(main())
