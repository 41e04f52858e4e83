"""Run-time kernel loader: cuda_src/*.cu -> CuPy RawModule (NVRTC) -> a launchable kernel.

* Sources are read from ``cuda_src/`` and every local ``#include "..."`` is inlined, so the text handed to
  NVRTC is self-contained. CuPy's disk cache keys on that text (plus options and arch), so a change to any
  header changes the key; a hash of the whole ``cuda_src/`` tree is also defined (``CUFLASH_SRC_HASH``),
  so editing *any* file under cuda_src/ recompiles.
* One module per (source file, template instantiation, device). Modules are memoized in this process and
  CuPy's disk cache makes a second process compile nothing. ``precompile`` fills that cache in parallel.
* ``compile_offline`` compiles the exact same text with NVRTC for an explicit ``sm_XX`` and no GPU, with
  ``-Xptxas=-v`` so that CI can read registers, spills and local memory from the program log.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import time
import uuid
import warnings
from pathlib import Path

log = logging.getLogger("cuflash")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')

# Options shared by run-time and offline compilation (CuPy adds -ftz=true and its own -I at run time; we
# add -ftz=true offline too so the offline cubin is the one the GPU runs).
NVRTC_OPTIONS = ("-std=c++17",)

MIN_CC = 80


def source_dir() -> Path:
    """cuda_src/ of an installed wheel (cuflash/cuda_src) or of a checkout (<repo>/cuda_src)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError("cuflash: cannot find the cuda_src/ directory next to the package")


@functools.lru_cache(maxsize=None)
def tree_hash() -> str:
    """sha256 over every file under cuda_src/ (path and bytes): part of every kernel's cache key."""
    h = hashlib.sha256()
    root = source_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h"):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _inline(path: Path, seen: set) -> str:
    out = []
    for line in path.read_text().splitlines():
        m = _INCLUDE_RE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if not inc.is_file():
                inc = (source_dir() / m.group(1)).resolve()
            if inc not in seen:  # every local header is include-once
                seen.add(inc)
                out.append(f"// ---- begin {m.group(1)}")
                out.append(_inline(inc, seen))
                out.append(f"// ---- end {m.group(1)}")
            continue
        out.append(line)
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def assemble(filename: str) -> str:
    """Self-contained source for cuda_src/<filename>: local includes inlined, tree hash defined."""
    path = source_dir() / filename
    body = _inline(path, {path.resolve()})
    return f"#define CUFLASH_SRC_HASH 0x{tree_hash()}ull\n{body}\n"


# --------------------------------------------------------------------------------------------- run time
_lock = threading.Lock()
_modules: dict = {}


def device_cc(device_id: int) -> int:
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    if cc < MIN_CC:
        raise RuntimeError(
            f"cuflash needs compute capability >= {MIN_CC // 10}.{MIN_CC % 10} (sm_80, mma.sync bf16, cp.async); "
            f"device {device_id} is sm_{cc}"
        )
    return cc


_first_compile = [True]


def _note_compile(name_expression: str, seconds: float) -> None:
    """A process's first kernel compile says so once, at WARNING (seen by default: the first call of a shape
    family takes seconds); later ones, and loads from the disk cache, at INFO / DEBUG."""
    if seconds >= 0.5 and _first_compile[0]:
        _first_compile[0] = False
        log.warning("cuflash: compiling kernels with NVRTC on first use (%s: %.1f s; each new configuration "
                    "compiles once, later processes load it from the disk cache; `python -m cuflash.precompile` "
                    "compiles ahead of time; logger 'cuflash' at INFO lists each one)", name_expression, seconds)
    elif seconds >= 0.5:
        log.info("cuflash: compiled %s in %.1f s", name_expression, seconds)
    else:
        log.debug("cuflash: loaded %s in %.3f s", name_expression, seconds)


def get_function(filename: str, name_expression: str, device_id: int, arch_suffix: str = ""):
    """The kernel for one template instantiation, compiled for `device_id`'s arch (memoized): a cupy.RawKernel,
    or with arch_suffix ("a": sm_90a's wgmma and setmaxnreg) a _CubinKernel compiled for exactly that target."""
    key = (filename, name_expression, device_id, arch_suffix)
    fn = _modules.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        fn = _modules.get(key)
        if fn is None:
            cc = device_cc(device_id)
            t0 = time.perf_counter()
            with cupy.cuda.Device(device_id):
                if arch_suffix:
                    fn = _CubinKernel.build(filename, name_expression, cc, arch_suffix)
                else:
                    mod = cupy.RawModule(
                        code=assemble(filename), options=NVRTC_OPTIONS, name_expressions=(name_expression,)
                    )
                    try:
                        fn = mod.get_function(name_expression)
                        fn.kernel  # force compile + load now, so errors carry the NVRTC log here
                    except cupy.cuda.compiler.CompileException as e:
                        raise RuntimeError(f"cuflash: NVRTC failed on {filename} [{name_expression}]:\n{e}") from e
            _note_compile(name_expression, time.perf_counter() - t0)
            if fn.local_size_bytes:  # register spills: correct, but slower than the configuration was tuned for
                from cupy.cuda import nvrtc

                warnings.warn(f"cuflash: {name_expression} uses {fn.local_size_bytes} B of local memory per thread "
                              f"({fn.num_regs} registers) under NVRTC {'.'.join(map(str, nvrtc.getVersion()))}: "
                              f"register spills, expect it to run slower than measured", RuntimeWarning, stacklevel=2)
            _modules[key] = fn
    return fn


def cache_dir() -> Path:
    """Where arch-specific cubins are kept between processes: $CUFLASH_CACHE_DIR, else ~/.cache/cuflash."""
    d = os.environ.get("CUFLASH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuflash")
    return Path(d)


class _CubinKernel:
    """A kernel compiled by NVRTC for one exact target (sm_90a) and loaded from its cubin.

    CuPy's RawModule appends its own -arch option (sm_90 for an sm_90 device), which cannot hold sm_90a
    instructions, so these kernels are compiled here, with the offline path's options, and cached on disk
    (cache_dir(), keyed by the source text, options and NVRTC version). Offers what Launcher and the loader read
    of a RawKernel: kernel.ptr, num_regs, local_size_bytes, max_dynamic_shared_size_bytes."""

    __slots__ = ("module", "kernel", "name")

    def __init__(self, cubin: bytes, lowered: str):
        from cupy.cuda import function

        self.module = function.Module()
        self.module.load(cubin)
        self.kernel = self.module.get_function(lowered)
        self.name = lowered

    @classmethod
    def build(cls, filename: str, name_expression: str, cc: int, suffix: str):
        return cls(*cached_cubin(filename, name_expression, f"{cc}{suffix}"))

    def _attr(self, attr: int) -> int:
        from cupy.cuda import driver

        return driver.funcGetAttribute(attr, self.kernel.ptr)

    @property
    def num_regs(self) -> int:
        return self._attr(4)  # CU_FUNC_ATTRIBUTE_NUM_REGS

    @property
    def local_size_bytes(self) -> int:
        return self._attr(3)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attr(8)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        from cupy.cuda import driver

        driver.funcSetAttribute(self.kernel.ptr, 8, value)


# ------------------------------------------------------------------------------------- offline (no GPU)
def cached_cubin(filename: str, name_expression: str, arch: str) -> tuple:
    """(cubin, lowered name) of one kernel for sm_<arch> (e.g. "90a"), from the disk cache (cache_dir()) or
    compiled (compile_offline) and stored there. The key covers the source text, the name expression, the target,
    the options and the NVRTC version. Processes that compile the same kernel at once (torchrun ranks) each write
    a private temporary file and rename it into place (atomic on POSIX): a reader sees a whole file or none, and
    whichever writer renames last leaves its cubin (NVRTC's cubins of one program differ in a 16-byte build
    identifier only; the code is the same)."""
    from cupy.cuda import nvrtc

    src = assemble(filename)
    h = hashlib.sha256("\0".join((src, name_expression, arch, repr(NVRTC_OPTIONS),
                                  ".".join(map(str, nvrtc.getVersion())))).encode()).hexdigest()[:32]
    d = cache_dir()
    cubin_p, name_p = d / f"{h}.cubin", d / f"{h}.name"
    try:
        cubin, lowered = cubin_p.read_bytes(), name_p.read_text()
        if cubin and lowered:
            return cubin, lowered
    except OSError:  # not cached yet
        pass
    res = compile_offline(filename, [name_expression], arch, verbose=False)
    cubin, lowered = res["cubin"], res["kernels"][name_expression]["lowered"]
    try:
        d.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_p, cubin), (name_p, lowered.encode())):
            tmp = d / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, path)
    except OSError:  # a read-only cache folder: compile again next time
        pass
    return cubin, lowered


def _include_dirs() -> list:
    dirs = []
    try:
        import nvidia  # namespace package from nvidia-cuda-runtime

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cuda_runtime/include", "cu12/include"):
                d = os.path.join(base, sub)
                if os.path.isfile(os.path.join(d, "cuda_fp16.h")):
                    dirs.append(d)
    except ImportError:
        pass
    try:
        import cupy

        cupy_cuda = cupy.cuda.get_cuda_path() or ""
    except Exception:  # no CuPy CUDA path: the other candidates
        cupy_cuda = ""
    for d in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda", cupy_cuda):
        if d and os.path.isfile(os.path.join(d, "include", "cuda_fp16.h")):
            dirs.append(os.path.join(d, "include"))
    return dirs


_PTXAS_RE = re.compile(
    r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\d+a?)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<spill_st>\d+) bytes spill stores, (?P<spill_ld>\d+) bytes spill loads.*?"
    r"Used (?P<regs>\d+) registers",
    re.S,
)


def compile_offline(filename: str, name_expressions, arch, extra_options=(), verbose: bool = True) -> dict:
    """Compile like the run-time path, for sm_<arch> (arch: 80, 90, or "90a" for the arch-specific target),
    without a GPU; parse ptxas' resource report (verbose=False: no report, e.g. for the run-time cubins).

    Returns {"cubin": bytes, "log": str, "kernels": {name_expression: {"regs", "stack", "spill_st",
    "spill_ld", "lowered", "ptxas_warnings"}}} (ptxas_warnings: ptxas' warning lines, e.g. C7508 for an ignored
    setmaxnreg or C7510 for serialized wgmma). Raises RuntimeError with the NVRTC log on a compile error.
    """
    from cupy.cuda import nvrtc

    src = assemble(filename)
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        for ne in name_expressions:
            nvrtc.addNameExpression(prog, ne)
        opts = list(NVRTC_OPTIONS) + ["-ftz=true", f"-arch=sm_{arch}"] + (["-Xptxas=-v"] if verbose else [])
        opts += list(extra_options)
        opts += [f"-I{d}" for d in _include_dirs()]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {filename}:\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = {ne: nvrtc.getLoweredName(prog, ne) for ne in name_expressions}
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    by_mangled = {}
    for chunk in re.split(r"(?=ptxas info\s*: Compiling entry function)", log):
        m = _PTXAS_RE.search(chunk)
        if m:
            by_mangled[m.group("name")] = {k: int(m.group(k)) for k in ("regs", "stack", "spill_st", "spill_ld")}
    # ptxas' warnings, and its "Potential Performance Loss" notes, which it prints as info lines (C7512: wgmma
    # serialized) rather than warnings
    warn = [ln.strip() for ln in log.splitlines()
            if "ptxas" in ln.lower() and ("warning" in ln.lower() or "Performance Loss" in ln)]
    kernels = {}
    for ne, low in lowered.items():
        info = dict(by_mangled.get(low, {}))
        info["lowered"] = low
        info["ptxas_warnings"] = warn  # of the whole program (the checks compile one kernel per program)
        kernels[ne] = info
    return {"cubin": cubin, "log": log, "kernels": kernels}
