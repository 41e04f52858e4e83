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
import xml.etree.ElementTree as ET

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


def _pytest_cmd(xml, paths):
    return [sys.executable, "-m", "pytest", "-m", "gpu", f"--junitxml={xml}", "-q", "-rfEs", "-p", "no:cacheprovider",
            "-p", "bench.junit", *paths]


def _finish_part(xml, log_path, stream, rc, stopped):
    """After one pytest process: keep its XML, or write it from its stream (stopped, or no XML); the line why goes to
    its log."""
    from . import junit

    if stopped and os.path.isfile(xml) and os.path.isfile(stream) and junit.complete_xml(xml, stream):
        with open(log_path, "a") as log:  # pytest had ended its run and written the XML: kept
            log.write(f"\n{stopped}, after pytest had written {xml} for every test: kept\n")
    elif stopped or not os.path.isfile(xml):
        note = stopped or f"pytest exited with status {rc} without writing its XML"
        counts = junit.stream_to_junit(stream, xml, note) if os.path.isfile(stream) else None
        line = f"{note}; {xml} written from {stream}: {junit.summary(counts)}" if counts else f"{note}; no test ran"
        with open(log_path, "a") as log:
            log.write("\n" + line + "\n")


def read_paths(paths: str) -> str:
    """`paths` as a comma list: '@FILE' is the list in FILE (comma or line separated: paths, node ids, pytest
    arguments such as --deselect=ID)."""
    if not paths.startswith("@"):
        return paths
    with open(paths[1:]) as f:
        return ",".join(x.strip() for x in f.read().replace("\n", ",").split(",") if x.strip())


def list_test_files(paths, root=ROOT) -> list:
    """The test files of pytest paths (comma list): a directory gives its test_*.py files (sorted), a file or a node id
    stays as given."""
    out = []
    for p in (x for x in paths.split(",") if x):
        full = p if os.path.isabs(p) else os.path.join(root, p)
        if os.path.isdir(full):
            out += [os.path.join(p, f) for f in sorted(os.listdir(full)) if f.startswith("test_") and f.endswith(".py")]
        else:
            out.append(p)
    return out


def file_seconds(xml_path) -> dict:
    """{test module's file name ('test_a.py'): seconds} summed over a JUnit XML's test cases (pytest's classnames
    'tests.test_a' or 'tests.test_a.TestB'); {} when the file is missing or unreadable."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out = {}
    for case in root.iter("testcase"):
        module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), None)
        if module:
            out[module + ".py"] = out.get(module + ".py", 0.0) + float(case.get("time") or 0.0)
    return out


def shard(files, jobs, seconds=None, default=1.0) -> list:
    """Test files in `jobs` groups of about equal time: longest first, each to the group with the least so far
    (`seconds`: {file name: seconds} from an earlier run, `default` for a file it lacks). Empty groups dropped; each
    group keeps the files' given order."""
    seconds = seconds or {}
    weight = {f: seconds.get(os.path.basename(f.split("::")[0]), default) for f in files}
    groups = [[] for _ in range(max(1, jobs))]
    load = [0.0] * len(groups)
    for f in sorted(files, key=lambda f: -weight[f]):
        i = load.index(min(load))
        groups[i].append(f)
        load[i] += weight[f]
    order = {f: i for i, f in enumerate(files)}
    return [sorted(g, key=order.get) for g in groups if g]


# {test file name: seconds of its GPU tests} from serial runs on one H200, for sharding (`python -m bench all
# --test-jobs N / --test-part K/N`); files without GPU tests are absent (weight 1 s). Rewritten from JUnit XML of
# serial runs with `python -m bench test-times XML... --out bench/test_times.json`.
TIMES_JSON = os.path.join(ROOT, "bench", "test_times.json")


def load_test_times(path=TIMES_JSON) -> dict:
    """The per-file times of `path` (TIMES_JSON); {} when it is missing or unreadable."""
    import json

    try:
        with open(path) as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def times_main(argv=None) -> int:
    """python -m bench test-times XML [XML ...] --out FILE: the per-file times (file_seconds) of JUnit XML from serial
    runs as JSON (a later XML's file replaces an earlier one's), for TIMES_JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench test-times", description=times_main.__doc__.split("\n")[0])
    ap.add_argument("xml", nargs="+", help="JUnit XML of serial GPU-test runs (one pytest process on one GPU)")
    ap.add_argument("--out", default=TIMES_JSON, help="the JSON to write (default: bench/test_times.json)")
    args = ap.parse_args(argv)
    times = {}
    for path in args.xml:
        found = file_seconds(path)
        if not found:
            raise SystemExit(f"{path}: no test cases read")
        times.update(found)
    with open(args.out, "w") as f:
        json.dump({k: round(v, 1) for k, v in sorted(times.items())}, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(times)} files, {sum(times.values()):.0f} s")
    return 0


def part_test_files(paths, part: str, seconds=None) -> list:
    """Part 'K/N' (1 <= K <= N) of the test files of `paths`: group K of shard(files, N) by `seconds` (TIMES_JSON's
    when None), so that N runs of the one command, one part each, run every test file once."""
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ValueError(f"test part {part!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise ValueError(f"test part {part!r}: K must be in 1..N")
    groups = shard(list_test_files(paths), n, load_test_times() if seconds is None else seconds)
    return groups[k - 1] if k <= len(groups) else []


def visible_devices() -> list:
    """The GPUs a child process may use, as CUDA_VISIBLE_DEVICES entries: that variable's own list when set, else one
    entry per line of `nvidia-smi -L` ([] when neither says)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def gpu_tests(out_dir, paths="tests", deadline=None, jobs=1, times=TIMES_JSON):
    """python -m pytest -m gpu on `paths` (comma list): junit XML in gpu-tests.xml, the text log in tests.log, and
    each test's outcome the moment it is known in tests.jsonl (the plugin bench/junit.py). deadline (time.time()
    seconds; None: none) or SIGTERM: pytest is stopped, and gpu-tests.xml is written from tests.jsonl with a note saying
    so (unless pytest had already written its own XML for every test: kept, the stop noted in tests.log); the same
    when pytest ends without writing its XML.

    jobs > 1: the test files in `jobs` groups of about equal time (shard, by the times in the JSON `times`), one pytest
    process per group at once, group K on visible GPU K modulo their count (each group's XML, log and stream as
    gpu-tests.partK.xml, tests.partK.log, tests.partK.jsonl), then gpu-tests.xml, tests.log and tests.jsonl made of
    them. For machines of several GPUs: four processes on one H200 ran each test about 5x slower than one process
    did (3513 tests: 1890 s summed against 381 s), so one GPU takes one process. Returns pytest's exit status (the
    worst of the groups': the first nonzero), or "stopped"."""
    from . import junit

    paths = read_paths(paths)
    t0 = time.time()
    xml = os.path.join(out_dir, "gpu-tests.xml")
    log_path = os.path.join(out_dir, "tests.log")
    stream = os.path.join(out_dir, "tests.jsonl")
    groups = [[p for p in paths.split(",") if p]]
    if jobs > 1:
        groups = shard(list_test_files(paths), jobs, load_test_times(times) if times else None)
    tags = [""] if len(groups) == 1 else [f".part{i}" for i in range(len(groups))]
    parts = [(os.path.join(out_dir, f"gpu-tests{t}.xml"), os.path.join(out_dir, f"tests{t}.log"),
              os.path.join(out_dir, f"tests{t}.jsonl")) for t in tags]
    for files in parts:
        for f in (files[0], files[2]):
            if os.path.exists(f):
                os.remove(f)
    stopped = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    procs, logs = [], []
    try:
        devices = visible_devices() if len(groups) > 1 else []
        for i, (group, (part_xml, part_log, part_stream)) in enumerate(zip(groups, parts)):
            env = _env()
            env[junit.STREAM_ENV] = part_stream
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
            logs.append(open(part_log, "w"))
            procs.append(subprocess.Popen(_pytest_cmd(part_xml, group), env=env, cwd=ROOT, stdout=logs[-1],
                                          stderr=subprocess.STDOUT))
        rcs = [None] * len(procs)
        try:
            for i, proc in enumerate(procs):
                rcs[i] = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
        except (subprocess.TimeoutExpired, _Stopped) as e:
            why = "the time limit" if isinstance(e, subprocess.TimeoutExpired) else "SIGTERM"
            stopped = f"stopped by {why} after {time.time() - t0:.0f} s"
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for i, proc in enumerate(procs):
                try:
                    rcs[i] = proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rcs[i] = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for f in logs:
            f.close()
    if stopped:
        rc = "stopped"
    else:
        rc = next((r for r in rcs if r), 0)
    for (part_xml, part_log, part_stream), part_rc in zip(parts, rcs):
        _finish_part(part_xml, part_log, part_stream, part_rc, stopped)
    if len(parts) > 1:
        done = [p for p in parts if os.path.isfile(p[0])]
        notes = []
        for p in done:
            notes += [e.get("value") for e in ET.parse(p[0]).getroot().iter("property") if e.get("name") == "note"]
        counts = junit.merge_xml([p[0] for p in done], xml, notes[0] if notes else None, at_once=True)
        with open(stream, "w") as out:
            for p in parts:
                if os.path.isfile(p[2]):
                    with open(p[2]) as f:
                        out.write(f.read())
        with open(log_path, "w") as out:
            out.write(f"{len(parts)} pytest processes at once, the test files sharded by time\n")
            for i, (group, p) in enumerate(zip(groups, parts)):
                out.write(f"\n===== part {i}: {' '.join(group)}\n")
                with open(p[1]) as f:
                    out.write(f.read())
            out.write(f"\nall parts: {junit.summary(counts)}\n")
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


def run_all(out_dir, suites, tests="tests", options=None, do_precompile=True, jobs=None, time_limit_min=None,
            test_jobs=1, test_part=None):
    """Precompile, the GPU tests (`test_jobs` pytest processes at once: gpu_tests) and the sanitizer runs (sanitize,
    with the tests), then the suites (run_suites;
    `time_limit_min`: the whole run's minutes, precompile and tests included, past which no suite is started and the
    GPU tests are stopped, their XML written from what ran)."""
    os.makedirs(out_dir, exist_ok=True)
    if test_part and tests and tests != "none":  # before anything runs: a bad K/N fails here
        tests = ",".join(part_test_files(read_paths(tests), test_part)) or "none"
        print(f"GPU tests, part {test_part}: {tests}", flush=True)
    t0 = time.time()
    deadline = None if time_limit_min is None else t0 + 60.0 * time_limit_min
    if do_precompile:
        try:
            precompile(out_dir, jobs)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if tests and tests != "none":
        try:
            gpu_tests(out_dir, tests, deadline, jobs=test_jobs)
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
