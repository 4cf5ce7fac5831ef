"""The Macs this app plans for, and whether this Python can run it (standard library only).

**Presets** (``plan --machine NAME``, ``convert --machine NAME``, and the tests' Mac simulation):
each Mac's RAM and the GPU working set Metal recommends on it by default. MLX's
``mx.device_info()["max_recommended_working_set_size"]`` is ``MTLDevice.recommendedMaxWorkingSetSize``
(``mlx/backend/metal/device_info.cpp``; ``memory_size`` beside it is ``sysctl hw.memsize``), and it
is the budget :func:`mlx_dgemma.memory.device_budget` plans with on a real Mac. Its default is
about 2/3 of RAM up to 32 GB and 3/4 above, as llama.cpp's Metal backend logs it on real Macs
(``ggml_metal_init: recommendedMaxWorkingSetSize``, in MiB): 10922.67 on 16 GB (llama.cpp #2209,
llama-cpp-python #687), 21845.34 on 32 GB (llama.cpp #2011 and #3606, ollama #434), 49152.00 on
64 GB (llama.cpp #1870); "the ~36 GB a 48 GB Mac budgets to the GPU" (osaurus #1958). Apple
documents neither the rule nor its values. A raised ``sysctl iogpu.wired_limit_mb`` replaces it
(Metal then reports that value: llmfit #754). macOS 26 reports more on large Macs: 107.52 GiB on
128 GB, measured on an M5 Max and on a Mac of an older chip (antirez/ds4 #890, #893); other sizes
are unmeasured under macOS 26, so the presets keep the rule (the lower figure) and the 128 GB
``-m5`` preset the measured one.

**M5-class GPUs** (the ``-m5`` presets): with macOS 26.2 or later MLX runs float32 matmuls with
reduced-precision NAX kernels (``metal::is_nax_available``), unless ``MLX_ENABLE_TF32=0``
(read once, default 1: ``mlx/utils.h``); ``exact`` is then not bit-exact.

**Raising the GPU's limit** (:func:`max_wired_limit_bytes`): never above RAM less
``max(2 GiB, RAM / 8)``. Wired memory cannot be paged or compressed; what is left must hold
macOS, the window server and the apps. 2 GiB is the least any MLX tool leaves (16 GB Macs run
at 14,336 MiB); an eighth keeps the same share on larger Macs, whose system and file cache grow
with RAM: 14,336 MiB on 16 GB and 114,688 MiB on 128 GB, the two values reported to run
(ds4 #893 on 128 GB).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
MIN_MACOS = 14  # MLX 0.32's wheels (macosx_14_0_arm64 and later); macOS 13 stops at MLX 0.29.3
MIN_WIRED_MARGIN = 2 * GiB  # see the module's docstring


def default_working_set(ram_bytes: int) -> int:
    """Metal's default recommended working set on a Mac with ``ram_bytes`` (see the module)."""
    return ram_bytes * 2 // 3 if ram_bytes <= 32 * GiB else ram_bytes * 3 // 4


def max_wired_limit_bytes(ram_bytes: int) -> int:
    """The highest GPU limit this app ever suggests (``iogpu.wired_limit_mb``): RAM less
    ``max(2 GiB, RAM / 8)`` (see the module)."""
    return ram_bytes - max(MIN_WIRED_MARGIN, ram_bytes // 8)


@dataclass(frozen=True)
class Machine:
    """A Mac: its RAM and the GPU working set Metal recommends on it."""

    name: str  # "mac-24gb"; "this Mac" for the one running
    ram_bytes: int
    working_set_bytes: int
    measured: str = ""  # where its working set was reported on a real Mac ("" = the rule)
    nax: bool = False  # M5-class GPU: float32 matmuls run NAX (TF32-like) kernels by default

    @property
    def ram_gb(self) -> int:
        """RAM as Apple sells it ("24 GB" = 24 GiB)."""
        return round(self.ram_bytes / GiB)

    @property
    def max_wired_limit_bytes(self) -> int:
        return max_wired_limit_bytes(self.ram_bytes)

    @property
    def label(self) -> str:
        """Where a plan's budget comes from, in words."""
        return f"{self.name}: Metal's default working set with {self.ram_gb} GB of RAM"


def _preset(gb: int, m5: bool = False, working_set: int | None = None, measured: str = "") -> Machine:
    ram = gb * GiB
    return Machine(f"mac-{gb}gb" + ("-m5" if m5 else ""), ram,
                   working_set if working_set is not None else default_working_set(ram), measured, m5)


# The sizes Apple silicon Macs ship with; M5 variants where NAX changes `exact` (M5: 16, 24
# and 32 GB; M5 Max: 128 GB, where macOS 26's larger working set was measured).
MACHINES: dict[str, Machine] = {m.name: m for m in (
    _preset(8), _preset(16, measured="llama.cpp Metal log: 10922.67 MiB"), _preset(24),
    _preset(32, measured="llama.cpp Metal log: 21845.34 MiB"), _preset(36), _preset(48),
    _preset(64, measured="llama.cpp Metal log: 49152.00 MiB"), _preset(96), _preset(128), _preset(192),
    _preset(16, m5=True), _preset(24, m5=True), _preset(32, m5=True),
    _preset(128, m5=True, working_set=int(107.52 * GiB), measured="macOS 26, M5 Max: 107.52 GiB (ds4 #893)"),
)}


def machine(name: str, flag: str = "--machine") -> Machine:
    """The preset ``name``; a :class:`ParameterError` listing them otherwise."""
    from .errors import ParameterError

    if name not in MACHINES:
        raise ParameterError(f"{flag} {name!r}: expected one of {', '.join(MACHINES)}", param="machine")
    return MACHINES[name]


def this_mac(working_set_bytes: int | None = None) -> Machine | None:
    """This Mac as a :class:`Machine` (None elsewhere): its RAM, and ``working_set_bytes`` (MLX's
    figure, where MLX is loaded) or the figure without MLX: ``iogpu.wired_limit_mb`` if raised,
    else the default rule (the converter's planning, which never imports MLX)."""
    if sys.platform != "darwin":
        return None
    ram = _sysctl_int("hw.memsize") or _physical_ram()
    if working_set_bytes is None:
        wired_mb = _sysctl_int("iogpu.wired_limit_mb")
        working_set_bytes = wired_mb * MiB if wired_mb else default_working_set(ram)
    return Machine("this Mac", ram, working_set_bytes)


def _physical_ram() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - every macOS has both
        return 0


def _sysctl_int(name: str) -> int:
    """``sysctl -n NAME`` as an integer, or 0 (unknown name, not macOS)."""
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


# --------------------------------------------------------------------------------------------
# can this Python run MLX here?

CHECK_ARM64 = "python3 -c 'import platform; print(platform.machine())'"


def platform_problem(system: str | None = None, arch: str | None = None, macos: str | None = None) -> str | None:
    """Why this Python cannot run MLX on this Mac (one line), or None: an x86-64 Python on
    macOS (an Intel Mac, or Rosetta: MLX has no x86-64 macOS wheel) or a macOS before 14.
    Arguments default to this process's (tests pass others)."""
    system = sys.platform if system is None else system
    if system != "darwin":
        return None
    arch = platform.machine() if arch is None else arch
    if arch != "arm64":
        return (f"this Python runs as {arch} (an Intel Mac, or Rosetta on Apple silicon); MLX needs a native "
                f"arm64 Python on Apple silicon: install one (python.org's macOS installer or Homebrew's, "
                f"3.11 or later), make a venv with it and check with {CHECK_ARM64} (must print arm64)")
    macos = platform.mac_ver()[0] if macos is None else macos
    try:
        major = int(macos.split(".")[0])
    except ValueError:  # unknown: let MLX's own import decide
        return None
    if major < MIN_MACOS:
        return (f"macOS {macos}: MLX 0.32.2 and later need macOS {MIN_MACOS} or later (older MLX lacks the "
                "device figures the memory plan needs); update macOS (check with sw_vers)")
    return None


def metal_problem(metal_available: bool | None = None, mlx_version: str | None = None) -> str | None:
    """On macOS, why MLX cannot use the GPU (one line: an MLX built without Metal, or a Mac
    whose GPU Metal does not offer to it), or None. Imports MLX (on macOS only) unless told."""
    if sys.platform != "darwin":
        return None
    if metal_available is None or mlx_version is None:
        import mlx.core as mx

        metal_available = mx.metal.is_available() if metal_available is None else metal_available
        mlx_version = getattr(mx, "__version__", "?") if mlx_version is None else mlx_version
    if metal_available:
        return None
    return (f"MLX {mlx_version} here cannot use the GPU (no Metal); this app needs MLX with Metal on Apple "
            "silicon: in a native arm64 Python on macOS 14 or later, run "
            "pip install -U 'mlx>=0.32.2' (check with python3 -c 'import mlx.core as mx; print(mx.metal.is_available())')")
