"""The ``mlx-dgemma`` flags and request helpers several commands share.

The model flags (``--precision``, ``--dtype``, ``--memory-limit``, ``--quality``, one flag per
generation parameter), the memory plan before loading, the sampler flags as the core's request
with its errors restated in the flags' words, and loading with a progress bar. Standard library
only at the top: ``mlx_dgemma.cli`` imports this module to build its parser, before MLX.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import hold_interrupts
from .params import flags  # generation parameter -> its flag (standard library only)

if TYPE_CHECKING:
    from .plan import Plan
    from .request import GenerationRequest


DEMO_HELP = ("the built-in demo model: a tiny model trained on the King James Bible "
             "(not DiffusionGemma's weights)")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """One flag per generation parameter of the registry (``mlx_dgemma.params``, standard library)."""
    from .params import PARAMS

    g = p.add_argument_group("sampler (defaults from the model's generation_config.json)")
    add_quality_arg(g)
    for param in PARAMS:
        g.add_argument(param.flag, type=param.kind, dest=param.name, metavar=param.metavar, help=param.help)


def add_quality_arg(p: Any) -> None:
    """``--quality``: the speed/quality dial's settings (``mlx_dgemma.params.QUALITIES``)."""
    from .params import QUALITIES

    p.add_argument("--quality", choices=[q.name for q in QUALITIES], default=None,
                   help="speed/quality dial: " + "; ".join(f"{q.name} = {q.help}" for q in QUALITIES)
                        + " (default: max; a sampler flag given besides it wins)")


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--dtype``: the runtime precision (see mlx_dgemma.precision)."""
    from .tiers import PRECISIONS, TIER_ROWS

    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="runtime precision: " + "; ".join(f"{t.name} = {t.help}" for t in TIER_ROWS)
                        + "; auto (default) = fast, or the most exact tier that fits memory "
                        "(mlx-dgemma plan MODEL lists them)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype of the lossy precisions (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--memory-limit", metavar="SIZE", default=None,
                   help="memory the model may use, e.g. 14GB (default: what the device offers: Metal's recommended "
                        "working set, or available RAM); a precision that does not fit is refused before loading")


def planned_load(args: argparse.Namespace) -> Plan | None:
    """The memory plan of --model or --demo (``loader.plan_load``), made once, before the app or
    the server starts: ``plan.chosen`` is --precision after it (auto -> the most exact form that
    fits --memory-limit or the device); a model that does not fit is refused in one line. The
    plan carries the model it opened (nothing is loaded): pass it to the load
    (``open_model(plan=)``), which reads it without opening the file or planning again.
    None when no model is given."""
    if not getattr(args, "demo", False) and not getattr(args, "model", None):
        if getattr(args, "memory_limit", None) is not None:
            with hold_interrupts():  # the plan's module imports MLX
                memory_limit(args)  # a bad size is refused even with no model to plan yet
        return None
    # the plan imports MLX (the device's memory): Ctrl+C inside mlx.core's import was swallowed
    # (the server then started anyway) or aborted the process; reading a header takes a moment
    with hold_interrupts():
        from .loader import plan_load

        limit = memory_limit(args)
        if getattr(args, "demo", False):  # the demo is a model file like any other: planned the same
            from .demo import demo_file

            model = demo_file("trained")
        else:
            model = args.model
        # under mlx.launch: this rank's share, and the same precision on every rank
        return plan_load(model, args.precision, limit)


def memory_limit(args: argparse.Namespace) -> int | None:
    """``--memory-limit`` in bytes; None where the command has none or it was not given (given
    empty, it is refused like any other bad size, not taken as absent)."""
    value = getattr(args, "memory_limit", None)
    if value is None:
        return None
    from .plan import parse_size

    return parse_size(value)


def sampler_overrides(args: argparse.Namespace) -> GenerationRequest:
    """The sampler flags given, as the core's request: each checked (range, finiteness) before
    any loading (and before MLX is imported: the rules live in ``params``, standard library
    only); an error names the flag typed."""
    from .request import GenerationRequest

    given = {k: getattr(args, k) for k in flags() if getattr(args, k, None) is not None}
    with flag_errors(given):
        return GenerationRequest.of(given, quality=getattr(args, "quality", None))


@contextmanager
def flag_errors(overrides: Mapping[str, Any]) -> Iterator[None]:
    """Restate a ParameterError about a generation parameter set by a flag in the flag's
    words: ``--steps 0: must be ...`` (the registry's rule, as every front end says it); one
    that names a parameter in a sentence, whoever set it, names its flag."""
    from .errors import ParameterError

    try:
        yield
    except ParameterError as e:
        if e.param in flags() and not e.rule and e.param in str(e):  # named in a sentence: the flag instead
            raise ParameterError(str(e).replace(e.param, flags()[e.param]), param=e.param) from e
        if e.param not in overrides or not e.rule:
            raise
        from .params import PARAMS

        rule = e.rule
        for p in PARAMS:  # a rule between fields names the other by its label: here, by its flag
            if p.label and p.name in flags() and f"the {p.label} (" in rule:
                rule = rule.replace(f"the {p.label} (", f"{flags()[p.name]} (")
        said = ParameterError(str(e), param=e.param, rule=rule, note=e.note)
        raise ParameterError(said.restated(f"{flags()[e.param]} {overrides[e.param]!r}"), param=e.param, rule=rule,
                             note=e.note) from None


def flagged(events: Iterator[Any], overrides: Mapping[str, Any]) -> Iterator[Any]:
    """``events`` with the core's errors (a prompt and answer beyond the context) naming flags."""
    with flag_errors(overrides):
        yield from events


def load_for_cli(model: str | None, demo: bool, dtype: str | None = None, precision: str = "auto",
                 memory_limit: int | None = None, plan: Plan | None = None):
    """The :class:`~mlx_dgemma.runtime.Runtime` of --model or --demo (the core's ``open_model``; ``plan``:
    :func:`planned_load`'s), loading progress on stderr."""
    from .loader import open_model
    from .progress import ProgressBar

    bar = ProgressBar("loading", unit="tensors", scale=1)
    limit = {"memory_limit": memory_limit} if memory_limit is not None else {}
    return open_model(model, demo, precision, dtype, progress=lambda i, n, name: bar.update(i, n, name), plan=plan,
                      **limit)
