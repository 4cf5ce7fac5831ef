"""``mlx-dgemma``: convert, verify, generate, chat, bench.

Errors a user can act on print as one line and exit with status 2 (``--debug`` shows the
traceback); heavy imports happen inside the subcommands so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import DGemmaError, Terminated, terminate_as_interrupt


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert.converter import convert
    from .progress import ProgressBar

    import math

    from .errors import ParameterError

    if not (math.isfinite(args.max_shard_gb) and 0.001 <= args.max_shard_gb <= 1e6):
        raise ParameterError(f"--max-shard-gb {args.max_shard_gb}: must be a number of GB in [0.001, 1e6]")
    bar = ProgressBar("converting")
    report = convert(args.gguf, args.out_dir, compact=args.compact, force=args.force,
                     max_shard_bytes=int(args.max_shard_gb * 1e9),
                     progress=lambda done, total, i, n, name: bar.update(done, total, f"{i}/{n} {name}"))
    print("\n".join(report.summary_lines()))
    if args.verify:
        return _run_verify(args.out_dir, args.gguf)
    return 0


def _run_verify(out_dir: str, gguf: str) -> int:
    from .convert.verify import verify
    from .progress import ProgressBar

    bar = ProgressBar("verifying", unit="tensors", scale=1)
    report = verify(out_dir, gguf, progress=lambda i, n, name: bar.update(i, n, name))
    for line in report.mismatches:
        print(f"MISMATCH {line}")
    if report.compact:  # lossy by design: held to the error bounds its conversion recorded
        verdict = (f"a --compact directory: {report.exact} exact, {len(report.max_abs_error)} within the recorded "
                   "compact error bounds" if report.ok else f"{len(report.mismatches)} tensor(s) outside the "
                   "recorded compact error bounds")
    else:
        verdict = "all exact" if report.ok else f"{len(report.mismatches)} tensor(s) differ"
    print(f"verified {report.checked} tensors of {out_dir} against {gguf}: {verdict}")
    return 0 if report.ok else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    return _run_verify(args.out_dir, args.gguf)


DESCRIPTION = "Run DiffusionGemma from its GGUF files with MLX: convert, verify, generate, chat, bench."
EPILOG = """\
first time? the built-in demo (a tiny model trained on the KJV Bible) shows text denoising:
  mlx-dgemma chat --demo
then a real model (README: Using a real model):
  mlx-dgemma convert diffusiongemma-26B-A4B-it-Q4_K_M.gguf ~/models/dgemma
  mlx-dgemma chat --model ~/models/dgemma

mlx-dgemma COMMAND --help shows each command's options."""
DEBUG_HELP = "show tracebacks on errors"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="mlx-dgemma", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mlx-dgemma {__version__}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="repack a DiffusionGemma GGUF into an MLX model directory")
    c.add_argument("gguf", help="the .gguf file")
    c.add_argument("out_dir", help="output directory, created with its parents (must not exist unless --force)")
    c.add_argument("--compact", action="store_true",
                   help="smaller but lossy: float16 scales, 8-bit groups for Q6_K (default: exact)")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--verify", action="store_true", help="verify every tensor after converting")
    c.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GB)")
    c.set_defaults(func=_cmd_convert)

    v = sub.add_parser("verify", help="check a converted directory against its GGUF, bit for bit")
    v.add_argument("out_dir", help="the directory written by mlx-dgemma convert")
    v.add_argument("gguf", help="the .gguf file it was converted from")
    v.set_defaults(func=_cmd_verify)

    from . import commands  # generate, chat, bench (registered there to keep this file small)

    commands.register(sub)
    for command in sub.choices.values():  # --debug also after the subcommand (SUPPRESS: no clobbering)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP clean up like Ctrl+C
            return int(args.func(args) or 0)
    except DGemmaError as e:
        if args.debug:
            raise
        # one line whatever a file put in the message (names with newlines, control bytes)
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(e))
        print(f"mlx-dgemma {args.command}: error: {text}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        print(f"mlx-dgemma {args.command}: interrupted; nothing partial was kept", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
