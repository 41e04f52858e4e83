"""Compile every kernel configuration the package can launch, without a GPU, and read ptxas' report.

Used by the CPU tests (tests/conftest.py runs one parallel pass for all of them) and by hand:
`python -m cuflash._compile_check [-j JOBS] [--nvrtc LIBDIR] [--json]` prints registers / stack / spills per
kernel for sm_80 and sm_90 (`--json`: the reports as JSON, by arch).

One kernel per NVRTC program, as the run-time loader compiles it (one name expression per program): ptxas can
allocate the same kernel differently in a program that holds several (e.g. 255 registers and 16 B of stack in
a file-wide program, 254 and none alone; or the other way round), so only the one-kernel program says what the
GPU runs. Per kernel is also no slower in total than per file, and it spreads evenly over processes.

Register allocation differs between NVRTC releases: NVRTC 13.0 (the compiler of the H200 test machine's image)
spilled kernels that 13.5 fitted. A task names the NVRTC it is compiled with: None, the installed one (CuPy's),
or the lib folder of another one holding libnvrtc.so.13 (e.g. `pip install --target D
nvidia-cuda-nvrtc==13.0.88`, lib folder D/nvidia/cu13/lib), which the worker processes for that task load
through LD_PRELOAD; so one pass checks both the newest NVRTC and the one on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import NamedTuple

ARCHS = (80, 90)


class Task(NamedTuple):
    """One NVRTC program: one kernel (name expression) of cuda_src/<filename> for sm_<arch>, compiled with the
    installed NVRTC (nvrtc=None) or the libnvrtc.so.13 in the folder `nvrtc`."""

    filename: str
    name: str
    arch: int
    nvrtc: str | None = None
    suffix: str = ""  # "a": the arch-specific target sm_<arch>a (cuflash._launch.KernelSpec.arch_suffix)


def tasks(specs=None, archs=ARCHS, nvrtc=None) -> list:
    """The Tasks of `specs` (default: every configuration, cuflash._configs.all_specs()) for each arch in
    `archs` that the spec compiles for (min_arch), with NVRTC `nvrtc`; no duplicates."""
    if specs is None:
        from ._configs import all_specs

        specs = all_specs()
    out = {}
    for arch in archs:
        for s in specs:
            suffix = getattr(s, "arch_suffix", "")
            if getattr(s, "min_arch", 0) <= arch and (not suffix or s.min_arch == arch):
                out.setdefault(Task(s.filename, s.name, arch, nvrtc, suffix), None)
    return list(out)


def specs_by_file(specs=None, arch=None):
    """{filename: [name expressions]}; with `arch`, only the specs that compile for sm_<arch> (min_arch)."""
    if specs is None:
        from ._configs import all_specs

        specs = all_specs()
    by_file = defaultdict(list)
    for s in specs:
        if arch is not None and s.min_arch > arch:
            continue
        if s.name not in by_file[s.filename]:
            by_file[s.filename].append(s.name)
    return by_file


def default_jobs() -> int:
    """Worker processes: CUFLASH_COMPILE_JOBS, else the CPUs this process may run on."""
    env = os.environ.get("CUFLASH_COMPILE_JOBS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------- worker side
def _worker_main() -> int:
    """Read JSON tasks [filename, name, arch] from stdin, one a line; answer each with one JSON line on the
    original stdout: {"info": {...}, "cpu_s": ...} or {"error": "..."}. The first line says the NVRTC version."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed to stdout goes to stderr, not into the protocol
    from ._loader import compile_offline

    out.write(json.dumps({"nvrtc": nvrtc_version()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        filename, name, arch, suffix = json.loads(line)
        t = time.process_time()
        try:
            info = compile_offline(filename, [name], f"{arch}{suffix}")["kernels"][name]
            msg = {"info": info}
        except Exception as e:  # a compile error is a result: the test reports it with NVRTC's log
            msg = {"error": f"{type(e).__name__}: {e}"}
        msg["cpu_s"] = time.process_time() - t
        out.write(json.dumps(msg) + "\n")
    return 0


# ------------------------------------------------------------------------------------------- parent side
def _worker_env(nvrtc):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
    if nvrtc is not None:
        lib = os.path.join(nvrtc, "libnvrtc.so.13")
        if not os.path.isfile(lib):
            raise FileNotFoundError(f"no libnvrtc.so.13 in {nvrtc}")
        # the builtins library (libnvrtc-builtins.so.13.x) is found through LD_LIBRARY_PATH
        env["LD_PRELOAD"] = os.pathsep.join(x for x in (lib, os.environ.get("LD_PRELOAD")) if x)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (nvrtc, os.environ.get("LD_LIBRARY_PATH")) if x)
    return env


class _Worker:
    def __init__(self, nvrtc):
        self.nvrtc = nvrtc
        # setsid (a process group of its own), so that a signal to the caller's group (Ctrl-C, `timeout -s INT`
        # around pytest) interrupts the caller alone rather than killing the worker under a running task, which
        # would turn that task into a compile error; the worker ends when its stdin closes, with the caller
        self.proc = subprocess.Popen([sys.executable, "-m", "cuflash._compile_check", "--worker"],
                                     env=_worker_env(nvrtc), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self._stderr = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.version = json.loads(self._readline())["nvrtc"]

    def _drain(self):
        for line in self.proc.stderr:
            self._stderr = (self._stderr + [line])[-40:]

    def _readline(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"compile worker (NVRTC {self.nvrtc or 'installed'}) exited with status "
                               f"{self.proc.returncode}:\n{''.join(self._stderr)}")
        return line

    def run(self, task):
        self.proc.stdin.write(json.dumps([task.filename, task.name, task.arch, task.suffix]) + "\n")
        return json.loads(self._readline())

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


class CompilePass:
    """Compiles Tasks in `jobs` worker processes (each loads one NVRTC; a slot runs one task at a time, so at
    most `jobs` compile at once whatever the mix of NVRTCs). submit() returns at once; result() waits.

    Every task is compiled once per pass. Each result is {"regs", "stack", "spill_st", "spill_ld", "lowered",
    "nvrtc": version, "cpu_s": CPU seconds of the compile} or {"error": message, "nvrtc": ...}."""

    def __init__(self, jobs=None):
        self.jobs = jobs or default_jobs()
        self.results: dict = {}
        self.versions: dict = {}
        self._todo: queue.Queue = queue.Queue()
        self._pending = set()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._slots = 0
        self._broken: dict = {}  # nvrtc -> why its worker does not start (its tasks fail at once)
        self.wall_s = 0.0
        self._t0 = None

    def submit(self, task_list):
        """Queue the tasks not compiled or queued yet (returns at once); starts worker slots as needed."""
        start = 0
        with self._lock:
            new = [t for t in dict.fromkeys(task_list) if t not in self.results and t not in self._pending]
            if new and not self._pending:
                self._t0 = time.perf_counter()
            self._pending.update(new)
            for t in new:
                self._todo.put(t)
            start = min(self.jobs, len(self._pending)) - self._slots
            self._slots += max(0, start)
        for _ in range(start):
            threading.Thread(target=self._slot, daemon=True).start()
        return self

    def _slot(self):
        workers = {}
        try:
            while True:
                with self._lock:
                    try:
                        task = self._todo.get_nowait()
                    except queue.Empty:
                        self._slots -= 1  # all queued tasks are taken: this slot ends
                        return
                try:
                    w = workers.get(task.nvrtc)
                    if w is None:
                        if task.nvrtc in self._broken:
                            raise RuntimeError(self._broken[task.nvrtc])
                        try:
                            w = workers[task.nvrtc] = _Worker(task.nvrtc)
                        except Exception as e:
                            self._broken[task.nvrtc] = f"no compile worker for NVRTC {task.nvrtc or 'installed'}: {e}"
                            raise RuntimeError(self._broken[task.nvrtc]) from e
                        self.versions[task.nvrtc] = w.version
                    res = w.run(task)
                    res["nvrtc"] = w.version
                except Exception as e:  # worker start failed or it died: this task fails, the next gets a new one
                    bad = workers.pop(task.nvrtc, None)
                    if bad is not None:
                        bad.close()
                    res = {"error": f"{type(e).__name__}: {e}", "nvrtc": self.versions.get(task.nvrtc)}
                info = dict(res.get("info", {}), nvrtc=res["nvrtc"], cpu_s=res.get("cpu_s", 0.0))
                if "error" in res:
                    info["error"] = res["error"]
                with self._lock:
                    self.results[task] = info
                    self._pending.discard(task)
                    if not self._pending:
                        self.wall_s = time.perf_counter() - self._t0
                    self._done.notify_all()
        finally:
            for w in workers.values():
                w.close()

    def result(self, task_list) -> dict:
        """{task: result} for `task_list`, compiling what is missing; waits until they are done."""
        task_list = list(dict.fromkeys(task_list))
        self.submit(task_list)
        with self._lock:
            while any(t not in self.results for t in task_list):
                self._done.wait(1.0)
            return {t: self.results[t] for t in task_list}

    def cancel(self):
        """Drop the queued tasks (those compiling finish); result() of a dropped task queues it again."""
        with self._lock:
            while True:
                try:
                    self._pending.discard(self._todo.get_nowait())
                except queue.Empty:
                    break

    def dump(self, path):
        """Write every result so far as JSON: a list of {"filename", "name", "arch", "nvrtc", "result"}."""
        with self._lock:
            rows = [dict(t._asdict(), result=r) for t, r in self.results.items()]
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    def cpu_seconds(self) -> float:
        with self._lock:
            return sum(r.get("cpu_s", 0.0) for r in self.results.values())


def compile_tasks(task_list, jobs=None) -> dict:
    """{task: result} for every task, compiled in parallel (CompilePass)."""
    return CompilePass(jobs).result(task_list)


def by_name(results: dict) -> dict:
    """{name expression: result} of the results of one arch and one NVRTC."""
    keys = {(t.arch, t.nvrtc) for t in results}
    if len(keys) > 1:
        raise ValueError(f"results of several (arch, nvrtc): {sorted(keys, key=str)}")
    return {t.name: r for t, r in results.items()}


def resource_report(arch: int, specs=None, nvrtc=None, jobs=None) -> dict:
    """{name_expression: {"regs", "stack", "spill_st", "spill_ld", "lowered", ...}} for one arch: every spec
    compiled alone (the module docstring says why), in parallel."""
    return by_name(compile_tasks(tasks(specs, (arch,), nvrtc), jobs))


def nvrtc_version(libdir=None) -> str:
    """The installed NVRTC's version ("13.5"), or, with `libdir`, that of the libnvrtc.so.13 in it."""
    if libdir is not None:
        w = _Worker(libdir)
        w.close()
        return w.version
    from cupy.cuda import nvrtc

    return "%d.%d" % nvrtc.getVersion()


def report_with_nvrtc(libdir: str, jobs=None) -> dict:
    """{"nvrtc": "13.0", "reports": {arch: resource_report(arch)}} with the libnvrtc.so.13 of `libdir`."""
    p = CompilePass(jobs)
    reports = {a: by_name(p.result(tasks(None, (a,), libdir))) for a in ARCHS}
    return {"nvrtc": p.versions[libdir], "reports": reports}


def perf_warnings(info: dict) -> list:
    """ptxas' C75xx warnings of one kernel: C7508 (setmaxnreg ignored: no register cap at entry), C7510 / C7515
    and the like (wgmma serialized: the tensor cores wait for each product)."""
    return [w for w in info.get("ptxas_warnings", ()) if "C75" in w or "Performance Loss" in w]


def bad_kernels(report: dict) -> dict:
    """The entries of a {name: result} report that failed: compile error, no ptxas report, more than 255
    registers, spills or local memory, or a ptxas performance warning (C75xx: setmaxnreg ignored, wgmma
    serialized)."""
    bad = {}
    for name, info in report.items():
        if "error" in info or "regs" not in info or info["regs"] > 255 or info["stack"] or info["spill_st"] \
                or info["spill_ld"] or perf_warnings(info):
            bad[name] = info
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--worker"]:
        return _worker_main()
    ap = argparse.ArgumentParser(prog="python -m cuflash._compile_check")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: the CPUs)")
    ap.add_argument("--nvrtc", default=None, help="lib folder of another NVRTC (holding libnvrtc.so.13)")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = ap.parse_args(argv)
    p = CompilePass(args.jobs)
    p.submit(tasks(None, ARCHS, args.nvrtc))
    reports = {a: by_name(p.result(tasks(None, (a,), args.nvrtc))) for a in ARCHS}
    version = p.versions.get(args.nvrtc) or nvrtc_version(args.nvrtc)
    if args.json:
        json.dump({"nvrtc": version, "reports": reports}, sys.stdout)
        return 0
    print(f"NVRTC {version}")
    bad = 0
    for arch in ARCHS:
        failed = bad_kernels(reports[arch])
        bad += len(failed)
        for name, info in reports[arch].items():
            flag = "  <-- " + info["error"].splitlines()[0] if "error" in info else \
                "  <-- SPILL/LOCAL" if name in failed else ""
            print(f"sm_{arch} regs={info.get('regs', '?'):>3} stack={info.get('stack', '?'):>4} "
                  f"spill={info.get('spill_st', '?')}/{info.get('spill_ld', '?')}  {name}{flag}")
    n = sum(len(r) for r in reports.values())
    print(f"{n} compiles, {p.cpu_seconds():.0f} CPU s, {p.wall_s:.0f} s with {p.jobs} processes; {bad} failed",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
