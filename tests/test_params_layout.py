"""CPU: the host schemas of the kernel parameter blocks (cuflash/_params.py) match the C++ structs of
cuda_src/attn/params.cuh field by field -- name, order, byte offset, size -- for every struct the header
defines; and packing by name puts each value at its field's offset."""
import re
import struct

import pytest

from cuflash import _params
from cuflash._loader import source_dir

HEADER = source_dir() / "attn" / "params.cuh"
# C++ field types of the blocks and their sizes; the host kinds they map to (P pointer, q int64, f a float32 in an
# 8-byte slot: f32_slot, cuda_src/common/ptx.cuh). A bare double or float is no block field's type (a double would
# be converted in device code; a 4-byte float would break the 8-byte slots): the parser maps them to kinds no host
# schema uses, so the field-by-field check fails on them.
_SCALARS = {"int64_t": (8, "q"), "f32_slot": (8, "f"), "double": (8, "d"), "int": (4, "i"), "int32_t": (4, "i"),
            "float": (4, "float4")}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_structs(text: str) -> dict:
    """{struct name: [(field, kind, offset, size), ...]} of every `struct Name { ... };` in a header, with C
    layout rules (natural alignment) for the field types the parameter blocks use."""
    text = _strip_comments(text)
    structs = {}
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{(.*?)\}\s*;", text, flags=re.S):
        fields, off = [], 0
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            dm = re.fullmatch(r"((?:const\s+)?[A-Za-z_]\w*(?:\s+const)?(?:\s*\*+\s*(?:const\s*)?)?)\s*(.+)", decl)
            assert dm, f"cannot parse declaration {decl!r} in struct {m.group(1)}"
            ctype, names = dm.group(1).strip(), dm.group(2)
            for name in (n.strip() for n in names.split(",")):
                stars = name.count("*")  # `int64_t *a, *b` style
                name = name.replace("*", "").strip()
                assert re.fullmatch(r"[A-Za-z_]\w*", name), f"unsupported declarator {name!r} ({decl!r})"
                if "*" in ctype or stars:
                    size, kind = 8, "P"
                else:
                    base = ctype.replace("const", "").strip()
                    assert base in _SCALARS, f"unknown field type {ctype!r} of {m.group(1)}::{name}"
                    size, kind = _SCALARS[base]
                off = -(-off // size) * size  # natural alignment
                fields.append((name, kind, off, size))
                off += size
        structs[m.group(1)] = fields
    return structs


@pytest.fixture(scope="module")
def header_structs():
    return parse_structs(HEADER.read_text())


def test_parser_on_a_sample():
    got = parse_structs("""
        struct S {
          const void* q;   // comment; with a semicolon
          float* lse;      /* block comment */
          const int* seqlens;
          int64_t a, b,
                  c;
          f32_slot x;
          int n;
          double y;
          float z;
        };""")["S"]
    assert got == [("q", "P", 0, 8), ("lse", "P", 8, 8), ("seqlens", "P", 16, 8), ("a", "q", 24, 8),
                   ("b", "q", 32, 8), ("c", "q", 40, 8), ("x", "f", 48, 8), ("n", "i", 56, 4), ("y", "d", 64, 8),
                   ("z", "float4", 72, 4)]


def test_every_header_struct_has_a_host_schema(header_structs):
    host = {b.cname for b in _params.PARAM_BLOCKS}
    assert set(header_structs) == host, (set(header_structs), host)
    assert {"FwdParams", "BwdParams", "V1FwdParams", "V1BwdParams"} <= host


@pytest.mark.parametrize("block", _params.PARAM_BLOCKS, ids=lambda b: b.cname)
def test_layout_matches_the_header(header_structs, block):
    cxx = header_structs[block.cname]
    offsets = block.offsets()
    assert [f[0] for f in cxx] == list(block.names), "field names / order"
    for (name, kind, off, size), (hname, hkind) in zip(cxx, block.fields):
        assert kind == hkind, f"{block.cname}::{name}: C++ kind {kind}, host {hkind}"
        assert offsets[name] == (off, size), f"{block.cname}::{name}: C++ offset/size {(off, size)}, host {offsets[name]}"
        assert struct.calcsize(_params.struct_format(block.fields[:block.index[name]])) == off, name
    last = cxx[-1]
    assert block.size == last[2] + last[3] == struct.calcsize(block.format)


@pytest.mark.parametrize("block", _params.PARAM_BLOCKS, ids=lambda b: b.cname)
def test_pack_by_name_places_each_value_at_its_offset(block):
    values = {n: (float(i) + 0.5 if k == "f" else 1000 + i) for i, (n, k) in enumerate(block.fields)}
    raw = block.pack(**values)
    for name, (off, size) in block.offsets().items():
        code = {"P": "<Q", "q": "<q", "f": "<f"}[block.fields[block.index[name]][1]]
        assert struct.unpack_from(code, raw, off)[0] == values[name], name
        if code == "<f":  # the slot's other 4 bytes are zero
            assert raw[off + 4:off + 8] == bytes(4), name
    assert block.unpack(raw) == values
    # bind: the leading pointer fields per call, the rest fixed by name -- the same bytes
    ptrs = tuple(n for n, k in block.fields if k == "P")
    bound = block.bind(ptrs, **{n: v for n, v in values.items() if n not in ptrs})
    buf = bytearray(block.size)
    bound.pack_into(buf, *(values[n] for n in ptrs))
    assert bytes(buf) == raw


def test_values_checks_names():
    b = _params.FWD_PARAMS
    with pytest.raises(KeyError, match="no field"):
        b.values(0, not_a_field=1)
    with pytest.raises(KeyError, match="not given"):
        b.values(q=1)
    assert b.values(0, q=5)[0] == 5 and set(b.values(0, q=5)[1:]) == {0}
    with pytest.raises(ValueError, match="first fields"):
        b.bind(("k",))
    with pytest.raises(KeyError, match="both dynamic and constant"):
        b.bind(("q",), q=1)


@pytest.mark.parametrize("kernel,block", [("kvcache_append_kernel", "APPEND_ARGS"),
                                          ("paged_kv_gather_kernel", "GATHER_ARGS")])
def test_plain_args_match_the_kernel_signature(kernel, block):
    """The append and gather kernels take plain arguments (one 8-byte slot each): their blocks name them in order."""
    src = _strip_comments((source_dir() / "flash_fwd.cu").read_text())
    m = re.search(kernel + r"\s*\((.*?)\)\s*\{", src, flags=re.S)
    assert m
    names = [re.split(r"[\s*]+", a.strip())[-1] for a in m.group(1).split(",")]
    assert names == list(getattr(_params, block).names)
