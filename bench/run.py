"""Running suites and the one-command GPU run (`python -m bench all`): precompile, GPU tests, sanitizer runs, suites,
report.

Every suite runs inside try/except: a failing suite prints its traceback, leaves an error record, and the next
one runs. results.json is rewritten after every suite, so a run cut short keeps what it measured."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def precompile(out_dir, jobs=None, cwd=ROOT, log_name="precompile.log"):
    """Compile every kernel configuration the package can launch, in parallel (fills CuPy's disk cache); the log
    goes to out_dir. Sweep candidates compile when a sweep first launches them."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "cuflash.precompile", "-j", str(jobs or os.cpu_count() or 4)]
    env = _env()
    if cwd != ROOT:  # another tree: its own package first on the path
        env["PYTHONPATH"] = str(cwd) + os.pathsep + os.environ.get("PYTHONPATH", "")
    with open(os.path.join(out_dir, log_name), "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"precompile ({cwd}) rc={rc} in {time.time() - t0:.0f}s", flush=True)
    return rc


def gpu_tests(out_dir, paths="tests", deadline=None):
    """python -m pytest -m gpu on `paths` (comma list): junit XML in gpu-tests.xml, the text log in tests.log, and
    each test's outcome the moment it is known in tests.jsonl (the plugin bench/junit.py). deadline (time.time()
    seconds; None: none) or SIGTERM: pytest is stopped, and gpu-tests.xml is written from tests.jsonl with a note saying
    so (unless pytest had already written its own XML for every test: kept, the stop noted in tests.log); the same
    when pytest ends without writing its XML. Returns pytest's exit status, or "stopped"."""
    from . import junit

    t0 = time.time()
    xml = os.path.join(out_dir, "gpu-tests.xml")
    log_path = os.path.join(out_dir, "tests.log")
    stream = os.path.join(out_dir, "tests.jsonl")
    for f in (xml, stream):
        if os.path.exists(f):
            os.remove(f)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", f"--junitxml={xml}", "-q", "-rfEs", "-p", "no:cacheprovider",
           "-p", "bench.junit", *[p for p in paths.split(",") if p]]
    env = _env()
    env[junit.STREAM_ENV] = stream
    stopped = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
            except (subprocess.TimeoutExpired, _Stopped) as e:
                why = "the time limit" if isinstance(e, subprocess.TimeoutExpired) else "SIGTERM"
                stopped = f"stopped by {why} after {time.time() - t0:.0f} s"
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = "stopped"
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped and os.path.isfile(xml) and os.path.isfile(stream) and junit.complete_xml(xml, stream):
        with open(log_path, "a") as log:  # pytest had ended its run and written the XML: kept
            log.write(f"\n{stopped}, after pytest had written {xml} for every test: kept\n")
    elif stopped or not os.path.isfile(xml):
        note = stopped or f"pytest exited with status {rc} without writing its XML"
        counts = junit.stream_to_junit(stream, xml, note) if os.path.isfile(stream) else None
        line = f"{note}; {xml} written from {stream}: {junit.summary(counts)}" if counts else f"{note}; no test ran"
        with open(log_path, "a") as log:
            log.write("\n" + line + "\n")
    with open(log_path) as f:
        print("\n".join(f.read().strip().splitlines()[-25:]))
    print(f"GPU tests rc={rc} in {time.time() - t0:.0f}s", flush=True)
    return rc


# compute-sanitizer in the one-command run, on a Hopper GPU (compute capability 9.0): synccheck of the Hopper forward's
# kernels on small ragged shapes (bench/diag/sm90_check.py: the configured tiles, then the persistent form's
# variants), whose warpgroup-wide instructions (wgmma.fence / commit / wait: .aligned) every warp of a warpgroup must
# reach alike -- a wait in a branch that only some warps of a warpgroup take gives right outputs and is caught here
# only (bench/NOTES.md, "Hopper forward"). (tool, sm90_check arguments) per run; one log for all.
SANITIZER_RUNS = (("synccheck", ("--quick",)), ("synccheck", ("--persist", "--quick")))


def sanitizer_commands(tool: str) -> list:
    """The command lines of SANITIZER_RUNS with compute-sanitizer at path `tool` (exit status 1 on any error it
    reports)."""
    return [[tool, "--tool", name, "--error-exitcode", "1", sys.executable, "-m", "bench.diag.sm90_check", *args]
            for name, args in SANITIZER_RUNS]


def find_sanitizer():
    """compute-sanitizer's path: on PATH, else in the CUDA toolkit's bin (CUDA_HOME, /usr/local/cuda); None if none."""
    import shutil

    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        path = os.path.join(home, "bin", "compute-sanitizer") if home else None
        if path and os.access(path, os.X_OK):
            return path
    return None


def sanitize(out_dir, deadline=None, cc=None, tool=None):
    """SANITIZER_RUNS on a device of compute capability 9.0 (cc: as cuflash._loader.device_cc gives it, e.g. 90; read
    from device 0 when None), logged to out_dir/sanitizer-sm90-synccheck.log. Returns the runs' exit statuses
    ("stopped" for one cut by the deadline), or None when skipped: no usable device, another one, or no
    compute-sanitizer (the reason printed)."""
    if cc is None:
        try:
            from cuflash._loader import device_cc

            cc = device_cc(0)
        except Exception as e:  # noqa: BLE001 - no usable device: nothing to check
            print(f"sanitizer runs skipped: {type(e).__name__}: {e}", flush=True)
            return None
    if cc != 90:
        print(f"sanitizer runs skipped: sm_{cc} (they check the sm_90a kernels)", flush=True)
        return None
    tool = tool or find_sanitizer()
    if tool is None:
        print("sanitizer runs skipped: compute-sanitizer not found", flush=True)
        return None
    out = []
    with open(os.path.join(out_dir, "sanitizer-sm90-synccheck.log"), "w") as log:
        for cmd in sanitizer_commands(tool):
            log.write("# " + " ".join(cmd[:5] + ["python"] + cmd[6:]) + "\n")
            log.flush()
            left = None if deadline is None else deadline - time.time()
            if left is not None and left < 30:
                log.write("# not run: the time limit\n")
                out.append("stopped")
                continue
            try:
                rc = subprocess.run(cmd, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=left).returncode
            except subprocess.TimeoutExpired:
                rc = "stopped"
            log.write(f"# exit status {rc}\n")
            out.append(rc)
    print(f"sanitizer runs: {out} (sanitizer-sm90-synccheck.log)", flush=True)
    return out


class _Stopped(Exception):
    """SIGTERM (a time limit) while a suite runs."""


def _on_sigterm(signum, frame):
    raise _Stopped()


def run_suites(names, out_dir, options=None, head=None, records=None, deadline=None):
    """Run the suites `names` in order; records filed under the suite's name. Returns (header, records).
    results.json is saved after every suite; on SIGTERM the records the running suite had made so far are saved
    (header `suite_status`: "stopped") and the run ends. deadline (time.time() seconds): a suite whose rough time
    (Suite.minutes, of the whole suite: options that shrink it do not count) would end past it is not started
    (`suite_status`: "skipped (time limit)"); the next ones may still fit."""
    from . import harness
    from .suites import SUITES

    options = options or {}
    if head is None:
        try:
            head = harness.header()
        except Exception:  # noqa: BLE001 - no GPU / torch: the suites will say why
            traceback.print_exc()
            head = dict(header_error=traceback.format_exc(limit=1)[-500:])
    records = records if records is not None else []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for name in names:
            t1 = time.time()
            if deadline is not None and t1 + 60.0 * SUITES[name].minutes > deadline:
                head.setdefault("suite_status", {})[name] = "skipped (time limit)"
                print(f"== {name} skipped: about {SUITES[name].minutes:.1f} min, {max(0.0, deadline - t1) / 60:.1f} "
                      f"min left before the time limit", flush=True)
                continue
            print(f"== {name}", flush=True)
            harness.LIVE = []
            status = "done"
            try:
                recs = SUITES[name].run(**options)
            except _Stopped:
                recs, status = list(harness.LIVE), "stopped"
                print(f"== {name} stopped (SIGTERM) after {len(recs)} records", flush=True)
            except Exception:  # noqa: BLE001 - one broken suite must not lose the others
                traceback.print_exc()
                recs = [dict(provider="error", error=traceback.format_exc()[-2000:])]
            finally:
                harness.LIVE = None
            for r in recs:
                r.setdefault("section", name)
            records += recs
            dt = time.time() - t1
            head.setdefault("suite_seconds", {})[name] = round(dt, 1)
            head.setdefault("suite_status", {})[name] = status
            print(f"== {name} {status} in {dt:.0f}s", flush=True)
            if out_dir:
                harness.save(os.path.join(out_dir, "results.json"), head, records)
            if status == "stopped":
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
    return head, records


def write_report(head, records, out_dir):
    from . import report

    try:
        report.write_all(head, records, out_dir)
    except Exception:  # noqa: BLE001 - the records are saved; the tables can be regenerated
        traceback.print_exc()


def run_all(out_dir, suites, tests="tests", options=None, do_precompile=True, jobs=None, time_limit_min=None):
    """Precompile, the GPU tests and the sanitizer runs (sanitize, with the tests), then the suites (run_suites;
    `time_limit_min`: the whole run's minutes, precompile and tests included, past which no suite is started and the
    GPU tests are stopped, their XML written from what ran)."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    deadline = None if time_limit_min is None else t0 + 60.0 * time_limit_min
    if do_precompile:
        try:
            precompile(out_dir, jobs)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if tests and tests != "none":
        try:
            gpu_tests(out_dir, tests, deadline)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        try:
            sanitize(out_dir, deadline)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    names = list(suites)
    if names and "ceilings" not in names:
        names.insert(0, "ceilings")
    head, records = {}, []
    if names:
        head, records = run_suites(names, out_dir, options, deadline=deadline)
        write_report(head, records, out_dir)
    print(f"total {time.time() - t0:.0f}s; results in {out_dir}", flush=True)
    return head, records
