"""CPU: the host path of the Hugging Face integration (cuflash.integrations.transformers) over a simulated greedy
generation loop, the GPU stood in:

* without padding (mask None), a growing KV cache in transformers' [batch, heads, keys, headdim] layout: one plan
  for the prefill and one for all the steps (cuflash._fwd._KV_PLANS), validation only when a plan is made, and every
  step's launch -- kernel, grid, parameter block, Q / K / V tensor maps -- byte for byte the one a fresh plan of the
  same tensors makes (the GQA fold on the mma.sync kernels, the Hopper kernels, a sliding window whose left edge
  lies beyond the keys at first); invalid k / v strides and addresses still raise after valid steps;
* with padding (a 2-D mask), a numpy stand-in of torch: one packing (torch.nonzero: a wait for the device) per mask
  tensor and query length instead of two per layer, the same indices, prefix sums and output as packing in every
  layer, and a new packing after an in-place change of the mask or for a new mask tensor.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import launch_params, run_with_stand_ins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_GEN = r"""
import types
from cuflash import _fwd
tfm = types.ModuleType("transformers")  # the registry only (no transformers on a CPU test machine)
tfm.AttentionInterface = types.SimpleNamespace(register=lambda name, fn: None)
sys.modules["transformers"] = tfm
from cuflash.integrations import transformers as integ
from cuflash import flash

counts = dict(plans=0, checks=0)
real_make, real_check = _fwd._make_plan, _fwd.check_qkv

def make(*a, **kw):
    counts["plans"] += 1
    return real_make(*a, **kw)

def check(*a, **kw):
    counts["checks"] += 1
    return real_check(*a, **kw)

_fwd._make_plan, _fwd.check_qkv = make, check
module = types.SimpleNamespace(is_causal=True)

def hf(shape, dt, strides=None):  # a [b, s, h, d] tensor seen as transformers' [b, h, s, d]
    return T(shape, dt, strides).transpose(1, 2)

def fresh(fn):  # the launch of fn with empty plan memos (what a first call, or the code before the KV memo, makes)
    saved = dict(_fwd._PLANS), dict(_fwd._KV_PLANS), dict(counts)
    _fwd._PLANS.clear(); _fwd._KV_PLANS.clear()
    rec, _ = launches(fn)
    _fwd._PLANS.clear(); _fwd._KV_PLANS.clear()
    _fwd._PLANS.update(saved[0]); _fwd._KV_PLANS.update(saved[1]); counts.update(saved[2])
    return rec

for tag, (b, h, hk, d, window) in dict(gqa_fold=(4, 16, 4, 128, None), sm90=(2, 8, 8, 128, None),
                                       window=(2, 8, 2, 64, 100), window_sm80=(2, 4, 4, 32, 70)).items():
    _fwd._PLANS.clear(); _fwd._KV_PLANS.clear()
    counts.update(plans=0, checks=0)
    dt, layers, prefill, steps = torch.bfloat16, 3, 64, 12
    kw = dict(dropout=0.0, scaling=d ** -0.5, sliding_window=window)
    recs, per_step = [], []
    for t in range(steps + 1):
        sq, sk = (prefill, prefill) if t == 0 else (1, prefill + t)
        q = hf((b, sq, h, d), dt)
        # the cache's keys: a new [b, hk, sk, d] array each step, seen as [b, sk, hk, d] (strides grow with sk)
        kv = [(T((b, hk, sk, d), dt), T((b, hk, sk, d), dt)) for _ in range(layers)]
        p0 = counts["plans"]
        for k, v in kv:
            call = lambda: integ.cuflash_attention_forward(module, q, k, v, None, **kw)
            rec, (out, none) = launches(call)
            ref = fresh(call)
            assert len(rec) == len(ref) == 1
            recs.append((rec[0], ref[0]))
        per_step.append(counts["plans"] - p0)
    res[tag] = dict(plans=counts["plans"], checks=counts["checks"], per_step=per_step, launches=recs,
                    kv_plans=len(_fwd._KV_PLANS), steps=sorted({r[0][0] for r in recs[layers:]}))

# after valid steps: k / v strides validation refuses, a misaligned k, a k / v key-count mismatch still raise
b, h, hk, d, sk = 2, 8, 2, 64, 80
q = hf((b, 1, h, d), torch.float16)
good = lambda n: T((b, hk, n, d), torch.float16)  # a cache array, transformers' layout
for n in (78, 79):
    integ.cuflash_attention_forward(module, q, good(n), good(n), None)
bad_stride = T((b, sk, hk, d), torch.float16, (hk * sk * d + 8, d, sk * d + 4, 1)).transpose(1, 2)
misaligned = good(sk); misaligned._ptr += 8
zero_head = T((b, sk, hk, d), torch.float16, (sk * d, d, 0, 1)).transpose(1, 2)
n0 = counts["plans"]
res["bad"] = dict(stride=err(lambda: integ.cuflash_attention_forward(module, q, bad_stride, good(sk), None)),
                  misaligned=err(lambda: integ.cuflash_attention_forward(module, q, good(sk), misaligned, None)),
                  mismatch=err(lambda: integ.cuflash_attention_forward(module, q, good(sk), good(sk + 1), None)))
# a stride of 0 (an expanded head: valid, not for tensor maps) takes the validating path and its own plan
rec, _ = launches(lambda: integ.cuflash_attention_forward(module, q, zero_head, zero_head, None))
res["zero_head"] = dict(rec=rec, ref=fresh(lambda: integ.cuflash_attention_forward(module, q, zero_head, zero_head,
                                                                                   None)))
"""


@pytest.fixture(scope="module")
def gen():
    return run_with_stand_ins(_GEN)


CASES = ("gqa_fold", "sm90", "window", "window_sm80")


@pytest.mark.parametrize("tag", CASES)
def test_generation_plans_once(gen, tag):
    r = gen[tag]
    # the prefill's plan and the steps' plan; each made once, validated once
    assert r["plans"] == 2 and r["checks"] == 2, r
    assert r["per_step"][:2] == [1, 1] and set(r["per_step"][2:]) == {0}
    assert r["kv_plans"] == 2


@pytest.mark.parametrize("tag", CASES)
def test_generation_launch_equals_fresh_plan(gen, tag):
    for ours, ref in gen[tag]["launches"]:
        assert launch_params(ours) == launch_params(ref)


def test_generation_paths(gen):
    """The steps' kernels: single-query GQA folded on the mma.sync kernels, the Hopper kernels without GQA and with
    a window (a score modifier: no fold), the mma.sync kernels at head dim 32."""
    def kernels(tag):
        return {n.split("<")[0] for n in gen[tag]["steps"]}

    assert kernels("gqa_fold") == {"cuflash::flash_fwd_kernel"}
    assert kernels("sm90") == kernels("window") == {"cuflash::flash_fwd_sm90_kernel"}
    assert kernels("window_sm80") == {"cuflash::flash_fwd_kernel"}


@pytest.mark.parametrize("tag,exc,words", [
    ("stride", "no error", []),  # (rows that are not 16-byte units: the UA kernels)
    ("misaligned", "no error", []),
    ("mismatch", "ValueError", ["v", "shape of k"]),
])
def test_bad_kv_after_steps(gen, tag, exc, words):
    e, msg = gen["bad"][tag]
    assert e == exc and all(w in msg for w in words), (e, msg)


def test_zero_stride_head(gen):
    r = gen["zero_head"]
    assert len(r["rec"]) == 1 and launch_params(r["rec"][0]) == launch_params(r["ref"][0])
    assert "sm90" not in r["rec"][0][0]


# --------------------------------------------------------------------------------------- padded batches
_PADDED = r"""
import json, sys, types
import numpy as np
sys.path.insert(0, ROOT)

# a numpy stand-in of the torch calls the padded path makes
torch = types.ModuleType("torch")
torch.int32, torch.bool, torch.float32 = np.int32, np.bool_, np.float32
calls = dict(nonzero=0, equal=0)
_ptr = [1 << 20]

class Tensor:
    def __init__(self, a, base=None):
        self.a = np.asarray(a)
        self.base = base
        self._ptr = base._ptr if base is not None else _ptr[0]
        _ptr[0] += 1 << 16
        self._v = [0] if base is None else base._v

    @property
    def _version(self):
        return self._v[0]

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    device = "cuda:0"
    def __rsub__(self, x): return Tensor(x - self.a)
    def __ge__(self, x): return Tensor(self.a >= x.a)
    def to(self, dt): return Tensor(self.a.astype(dt))
    def contiguous(self): return self
    def dim(self): return self.a.ndim
    def data_ptr(self): return self._ptr
    def is_inference(self): return False
    def bool(self): return self if self.a.dtype == np.bool_ else Tensor(self.a.astype(np.bool_))
    def sum(self, dim, dtype): return Tensor(self.a.sum(axis=dim, dtype=dtype))
    def flatten(self): return Tensor(self.a.reshape(-1))
    def max(self): return Tensor(self.a.max())
    def reshape(self, *s): return Tensor(self.a.reshape(s))
    view = reshape
    def transpose(self, i, j): return Tensor(np.swapaxes(self.a, i, j))
    def index_select(self, dim, idx): return Tensor(self.a[idx.a])
    def new_zeros(self, s): return Tensor(np.zeros(s, self.a.dtype))
    def index_copy(self, dim, idx, src):
        out = self.a.copy(); out[idx.a] = src.a
        return Tensor(out)
    def __getitem__(self, i): return Tensor(self.a[i], base=self)
    def zero_row_(self, r):  # an in-place change (bumps the version, as torch's in-place ops do)
        self.a[r] = 0; self._v[0] += 1

def nonzero(x, as_tuple=False):
    calls["nonzero"] += 1
    return Tensor(np.argwhere(x.a))

def equal(x, y):  # a flag read back from the device
    calls["equal"] += 1
    return bool(np.array_equal(x.a, y.a))

torch.Tensor, torch.nonzero, torch.equal = Tensor, nonzero, equal
torch.arange = lambda n, device=None: Tensor(np.arange(n))
torch.cumsum = lambda x, dim, dtype: Tensor(np.cumsum(x.a, axis=dim, dtype=dtype))
torch.nn = types.SimpleNamespace(functional=types.SimpleNamespace(pad=lambda x, p: Tensor(np.pad(x.a, p))))
torch.is_grad_enabled = lambda: False
sys.modules["torch"] = torch
tfm = types.ModuleType("transformers")
tfm.AttentionInterface = types.SimpleNamespace(register=lambda name, fn: None)
sys.modules["transformers"] = tfm
from cuflash import kvcache, varlen
from cuflash.integrations import transformers as integ

seen, leads = [], []

def varlen_stub(q, k, v, cu_q, cu_k, max_q, max_k, *opts):  # records the packing, returns q + k-sums per row
    seen.append([cu_q.a.tolist(), cu_k.a.tolist(), int(max_q.a), int(max_k.a), q.a.shape[0], k.a.shape[0]])
    return Tensor(q.a * 2.0)

def kvcache_stub(q, k_cache, v_cache, cache_leftpad=None, **kw):  # records each row's padding
    leads.append([cache_leftpad.a.tolist(), k_cache.a.shape[1], sorted(kw)])
    return Tensor(q.a * 2.0)

varlen.flash_attn_varlen_func = varlen_stub
kvcache.flash_attn_with_kvcache = kvcache_stub
module = types.SimpleNamespace(is_causal=True)
rng = np.random.default_rng(0)
b, h, hk, d, layers = 3, 4, 2, 8, 4
res = {}

def model_call(mask, sq, sk):
    # one model call: every layer gets the same mask tensor (transformers' create_causal_mask)
    n0, e0, s0, l0 = calls["nonzero"], calls["equal"], len(seen), len(leads)
    outs = []
    for _ in range(layers):
        q = Tensor(rng.standard_normal((b, sq, h, d)).astype(np.float32)).transpose(1, 2)
        k = Tensor(rng.standard_normal((b, sk, hk, d)).astype(np.float32)).transpose(1, 2)
        out, _ = integ.cuflash_attention_forward(module, q, k, k, mask)
        # the reference: packing from the mask itself
        m = mask.a.astype(bool)
        ref = np.zeros((b, sq, h, d), np.float32)
        qa = np.swapaxes(q.a, 1, 2)
        ref[m[:, -sq:]] = 2.0 * qa[m[:, -sq:]]
        outs.append(bool(np.array_equal(out.a, ref)))
    return dict(nonzero=calls["nonzero"] - n0, equal=calls["equal"] - e0, same_out=all(outs), packings=seen[s0:],
                leads=leads[l0:])

pad = np.ones((b, 40), np.int64)
pad[1, :7] = 0; pad[2, :31] = 0
mask = Tensor(pad.astype(bool))
res["prefill"] = model_call(mask, 40, 40)
step = Tensor(np.concatenate([pad, np.ones((b, 1), np.int64)], 1).astype(bool))
res["step"] = model_call(step, 1, 41)  # left padding: no packing, each row's padding to the KV-cache kernel
res["step_again"] = model_call(step, 1, 41)  # the same tensor, unchanged: nothing recomputed
step.zero_row_((0, 3))  # changed in place, a hole in row 0 (no longer left padding): packed
res["changed"] = model_call(step, 1, 41)
res["int_mask"] = model_call(Tensor(pad), 40, 40)  # a 0/1 integer mask: packed from its bool copy
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def padded():
    r = subprocess.run([sys.executable, "-c", _PADDED.replace("ROOT", repr(ROOT))], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT"):])


def test_padded_packing_once_per_mask(padded):
    assert padded["prefill"]["nonzero"] == 1  # keys and queries are the same columns
    assert padded["prefill"]["equal"] == 0  # several queries: no left-padding route
    assert (padded["step"]["nonzero"], padded["step"]["equal"]) == (0, 1)  # one left-padding test, no packing
    assert (padded["step_again"]["nonzero"], padded["step_again"]["equal"]) == (0, 0)
    assert (padded["changed"]["nonzero"], padded["changed"]["equal"]) == (2, 1)  # the keys' and the last column's
    assert padded["int_mask"]["nonzero"] == 1


def test_left_padded_step_skips_packing(padded):
    """A generation step whose mask is left padding runs the KV-cache kernel on the keys in place, with each row's
    padding count (rows of 41 keys: 0, 7 and 31 of padding), no score options when there are none."""
    for tag in ("step", "step_again"):
        r = padded[tag]
        assert r["same_out"] and r["packings"] == [], tag
        assert r["leads"] == [[[0, 7, 31], 41, ["causal", "softmax_scale"]]] * 4, (tag, r["leads"])
    assert padded["changed"]["leads"] == [] and padded["prefill"]["leads"] == []


def test_padded_packing_values(padded):
    cu = [0, 40, 73, 82]  # rows of 40, 33 and 9 real tokens
    for tag in ("prefill", "int_mask"):
        r = padded[tag]
        assert r["same_out"], tag
        assert all(p == [cu, cu, 40, 40, 82, 82] for p in r["packings"]), (tag, r["packings"][0])
    r = padded["changed"]
    assert r["same_out"] and all(p == [[0, 1, 2, 3], [0, 40, 74, 84], 1, 40, 3, 84] for p in r["packings"])
