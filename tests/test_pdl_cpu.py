"""CPU: Programmatic Dependent Launch of the decode step (cuflash/_launch.py, cuflash/_plan.py, cuflash/decode.py;
griddepcontrol in cuda_src/flash_decode.cu and the append kernel) without a GPU -- the ctypes CUlaunchConfig /
CUlaunchAttribute layouts against cuda.h, which kernels of a plan are launched with PDL (the combine after the split
kernel, the decode kernel after the append; never a kernel whose predecessor is the caller's), the launch config
built once per plan and stream, the switch (CUFLASH_PDL, plan_for(pdl=)), and the sm_80 code of the touched
kernels unchanged by the griddepcontrol calls. The spill checks of every configuration are tests/test_compile.py's.
GPU: PDL on and off bitwise equal, against the float64 reference, in CUDA graphs."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from cuflash import _configs, _launch, _loader
from conftest import run_result_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HO = "bench.diag.host_overhead"

# cuda.h (CUDA 12.x / 13.x): sizeof and offsetof of the launch structs on a 64-bit host
CUDA_H_LAYOUT = {"sizeof(CUlaunchAttributeValue)": 64, "sizeof(CUlaunchAttribute)": 72,
                 "offsetof(CUlaunchAttribute, value)": 8, "sizeof(CUlaunchConfig)": 56,
                 "offsetof(CUlaunchConfig, sharedMemBytes)": 24, "offsetof(CUlaunchConfig, hStream)": 32,
                 "offsetof(CUlaunchConfig, attrs)": 40, "offsetof(CUlaunchConfig, numAttrs)": 48}


def _ctypes_layout() -> dict:
    V, A, C = _launch.CUlaunchAttributeValue, _launch.CUlaunchAttribute, _launch.CUlaunchConfig
    return {"sizeof(CUlaunchAttributeValue)": ctypes.sizeof(V), "sizeof(CUlaunchAttribute)": ctypes.sizeof(A),
            "offsetof(CUlaunchAttribute, value)": A.value.offset, "sizeof(CUlaunchConfig)": ctypes.sizeof(C),
            "offsetof(CUlaunchConfig, sharedMemBytes)": C.sharedMemBytes.offset,
            "offsetof(CUlaunchConfig, hStream)": C.hStream.offset, "offsetof(CUlaunchConfig, attrs)": C.attrs.offset,
            "offsetof(CUlaunchConfig, numAttrs)": C.numAttrs.offset}


def test_launch_structs_match_cuda_h():
    assert _ctypes_layout() == CUDA_H_LAYOUT
    assert ctypes.alignment(_launch.CUlaunchAttributeValue) == 8
    a = _launch._PDL_ATTR
    raw = ctypes.string_at(ctypes.addressof(a), ctypes.sizeof(a))
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert _launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def _cuda_h():
    cands = [os.path.join(os.environ.get(v, ""), "include") for v in ("CUDA_PATH", "CUDA_HOME")]
    try:
        import nvidia

        cands += [os.path.join(b, "cu13", "include") for b in nvidia.__path__]
    except ImportError:
        pass
    cands += ["/usr/local/cuda/include"]
    return next((d for d in cands if os.path.isfile(os.path.join(d, "cuda.h"))), None)


def test_launch_structs_against_the_header(tmp_path):
    """The same numbers from the header itself, through the host C compiler (skipped without one or the header)."""
    inc, cc = _cuda_h(), shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("no cuda.h or no C compiler")
    src = tmp_path / "layout.c"
    body = "".join(f'  printf("%s %zu\\n", "{k}", (size_t){k});\n' for k in CUDA_H_LAYOUT)
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void) {\n" + body +
                   '  printf("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION %d\\n", '
                   "(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}
    assert got.pop("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION") == 6
    assert got == _ctypes_layout()


def test_switch_from_the_environment():
    code = "from cuflash import _launch; print(_launch.PDL)"
    env = dict(os.environ, PYTHONPATH=ROOT, CUFLASH_PDL="0")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    env.pop("CUFLASH_PDL")
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "True"


_SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, ROOT)
import importlib
ho = importlib.import_module(HO_MODULE)
torch = ho.install_fakes(record=True)
import cuflash
from cuflash import _launch, _loader, decode
T = torch.Tensor
res = {}

def kinds(plan):
    return [type(ex).__name__ if ex is not None else None for *_, ex in plan.launches]

def launches():  # kernel, grid, threads, smem, the parameters but the output pointers (new arrays each call)
    out = [[r[0], list(r[1]), r[2], r[3], (r[4][:29 * 8] if "append" in r[0] else r[4][13 * 8:512]).hex()]
           for r in ho.LAUNCHES]
    ho.LAUNCHES.clear()
    return out

def step(tag, *args, **kw):
    decode._PLANS.clear()
    ho.LAUNCHES.clear()
    cuflash.flash_attn_with_kvcache(*args, **kw)
    (plan,) = decode._PLANS.values()
    first = launches()
    cuflash.flash_attn_with_kvcache(*args, **kw)
    cuflash.flash_attn_with_kvcache(*args, **kw)
    again = launches()
    r = dict(pdl=plan.pdl, kinds=kinds(plan), append=kinds(plan.append) if plan.append else None,
             launches=first, repeat_same=[x[:4] for x in again] == [x[:4] for x in first + first])
    exs = [ex for *_, ex in plan.launches if ex is not None]
    r["configs"] = [len(ex.configs) for ex in exs]
    r["cfg"] = []
    for ex, (fn, gx, gy, gz, th, smem, _) in zip(exs, [l for l in plan.launches if l[-1] is not None]):
        c = ex.config(0)
        r["cfg"].append(dict(dims=[c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ,
                                   c.sharedMemBytes], expect=[gx, gy, gz, th, 1, 1, smem], stream=c.hStream,
                             num=c.numAttrs, id=c.attrs[0].id,
                             val=c.attrs[0].value.programmaticStreamSerializationAllowed,
                             same_object=ex.config(0) is c and ex.configs[0][0] == ctypes.addressof(c)))
    res[tag] = r

q = T((2, 1, 32, 128), torch.float16)
kc = T((2, 4096, 8, 128), torch.float16); vc = T((2, 4096, 8, 128), torch.float16)
sl = T((2,), torch.int32)
k1 = T((2, 1, 8, 128), torch.float16); v1 = T((2, 1, 8, 128), torch.float16)
step("split", q, kc, vc, cache_seqlens=sl)
step("one_split", q, kc, vc, cache_seqlens=sl, num_splits=1)
step("append", q, kc, vc, k1, v1, cache_seqlens=sl)
step("append_one_split", q, kc, vc, k1, v1, cache_seqlens=sl, num_splits=1)
_launch.PDL = False
step("split_off", q, kc, vc, cache_seqlens=sl)
step("append_off", q, kc, vc, k1, v1, cache_seqlens=sl)
_launch.PDL = True
res["plan_for"] = {m: decode.plan_for(q, kc, vc, cache_seqlens=sl, pdl=p).pdl
                   for m, p in (("none", None), ("on", True), ("off", False))}
res["warp"] = kinds(decode.plan_for(q, kc, vc, cache_seqlens=sl, combine="warp"))
res["rows"] = kinds(decode.plan_for(q, kc, vc, cache_seqlens=sl, num_splits=3))
_loader.device_cc = lambda device: 80
_launch._pdl_capable.cache_clear()
res["sm80"] = decode.plan_for(q, kc, vc, k1, v1, cache_seqlens=sl).pdl
_loader.device_cc = lambda device: 90
_launch._pdl_capable.cache_clear()
_launch._launch_ex = False  # a driver without cuLaunchKernelEx
res["no_ex"] = decode.plan_for(q, kc, vc, cache_seqlens=sl).pdl
bad = {}
for v in (1, "yes", 0.0):
    try:
        decode.plan_for(q, kc, vc, cache_seqlens=sl, pdl=v)
        bad[repr(v)] = "no error"
    except TypeError as e:
        bad[repr(v)] = str(e)
res["bad_pdl"] = bad
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def host():
    return run_result_script(_SCRIPT.replace("ROOT", repr(ROOT)).replace("HO_MODULE", repr(HO)))


def test_which_kernels_launch_with_pdl(host):
    # split: the decode kernel follows the caller's kernels (plain), the combine follows it (PDL)
    assert host["split"]["pdl"] and host["split"]["kinds"] == [None, "ProgrammaticLaunch"]
    assert host["append"]["pdl"] and host["append"]["kinds"] == ["ProgrammaticLaunch", "ProgrammaticLaunch"]
    assert host["append"]["append"] == [None]  # the append kernel follows the caller's kernels
    assert not host["one_split"]["pdl"] and host["one_split"]["kinds"] == [None]
    assert host["append_one_split"]["pdl"] and host["append_one_split"]["kinds"] == ["ProgrammaticLaunch"]
    assert host["warp"] == [None, None]  # flash_combine_kernel has no griddepcontrol.wait
    assert host["rows"] == [None, "ProgrammaticLaunch"]  # flash_decode_combine_rows_kernel waits like the block one
    assert host["sm80"] is False and host["no_ex"] is False


def test_switch_and_plan_for(host):
    assert not host["split_off"]["pdl"] and host["split_off"]["kinds"] == [None, None]
    assert not host["append_off"]["pdl"] and host["append_off"]["kinds"] == [None, None]
    assert host["plan_for"] == {"none": True, "on": True, "off": False}
    for v, msg in host["bad_pdl"].items():  # not a bool: a TypeError naming pdl, before any launch
        assert msg.startswith("pdl must be a bool"), (v, msg)
    # the same kernels, grids and parameter blocks with PDL on and off
    assert host["split"]["launches"] == host["split_off"]["launches"]
    assert host["append"]["launches"] == host["append_off"]["launches"]


def test_launch_config_built_once_per_plan_and_stream(host):
    for tag in ("split", "append"):
        r = host[tag]
        assert r["repeat_same"]
        assert r["configs"] and all(n == 1 for n in r["configs"])  # three calls on one stream: one config each
        for c in r["cfg"]:
            assert c["dims"] == c["expect"] and c["stream"] is None  # the fake's stream 0 (NULL)
            assert (c["num"], c["id"], c["val"]) == (1, 6, 1) and c["same_object"]


def test_config_cache_is_bounded():
    ex = _launch.ProgrammaticLaunch(0x1000, (5, 1, 1), 256, 0)
    first = ex.config(7)
    assert ex.config(7) is first
    for s in range(1, _launch.ProgrammaticLaunch.MAX_STREAMS + 5):
        ex.config(1000 + s)
    assert len(ex.configs) <= _launch.ProgrammaticLaunch.MAX_STREAMS and ex._old  # the previous generation kept
    assert (first.gridDimX, first.blockDimX, first.hStream, first.numAttrs) == (5, 256, 7, 1)


# ----------------------------------------------------------------------------------------- the kernels' code
def _touched_specs():
    specs = [s for s in _configs.all_specs() if "flash_decode_combine_kernel" in s.name
             or "flash_decode_combine_rows_kernel" in s.name or "kvcache_append_kernel" in s.name]
    return specs + [s for s in _configs.all_specs() if "flash_decode_kernel" in s.name and ", 128, " in s.name][:4]


@pytest.mark.parametrize("spec", _touched_specs(), ids=lambda s: s.name)
def test_griddepcontrol_only_on_sm90(spec):
    """sm_80: the kernel's SASS with the griddepcontrol calls is the one without them (CUFLASH_NO_GRIDDEP compiles
    them out everywhere); sm_90: they are there (the decode kernel and the combine wait, the decode and append
    kernels let dependents launch)."""
    from bench import bench_micro as bm

    if bm.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")

    def sass(arch, *opts):
        text, why = bm.cubin_sass(_loader.compile_offline(spec.filename, [spec.name], arch, opts, False)["cubin"])
        if text is None:
            pytest.skip(why)
        return [ln.split("*/", 1)[1] for ln in text.splitlines() if ln.strip().startswith("/*") and "*/" in ln]

    assert sass(80) == sass(80, "-DCUFLASH_NO_GRIDDEP")

    def opcodes(lines):
        return {ln.split(";")[0].split()[0] for ln in lines if ln.strip()}

    added = opcodes(sass(90)) - opcodes(sass(90, "-DCUFLASH_NO_GRIDDEP"))
    # griddepcontrol.wait -> ACQBULK, griddepcontrol.launch_dependents -> PREEXIT
    expect = {"flash_decode_kernel": {"ACQBULK", "PREEXIT"}, "flash_decode_combine_kernel": {"ACQBULK"},
              "flash_decode_combine_rows_kernel": {"ACQBULK"}, "kvcache_append_kernel": {"PREEXIT"}}
    assert added == next(v for k, v in expect.items() if f"::{k}<" in spec.name)
