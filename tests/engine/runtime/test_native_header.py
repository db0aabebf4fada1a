"""kvshare_native.h is the native library's one interface: every source includes it and defines
its entry points exactly as it declares them, the ctypes bindings are the ones it declares, and
the codes the Python side passes are its constants. A disagreement fails here, naming the
function or constant."""

from __future__ import annotations

import ctypes
import re
import shutil

import pytest
import torch

from engine.runtime.cpu import block_linear, decode_step, fused, native

HEADER = native.INTERFACE_HEADER.name
# The library's other files: sources, and headers internal to it.
OTHER_FILES = [path for path in (*native.SOURCES, *native.HEADERS) if path.name != HEADER]
# An entry point's definition or declaration at the start of a line (calls never start one with
# a type): its return type, name and parameters, then `{` for a definition or `;` for a
# declaration.
ENTRY_POINT = re.compile(r'^(?:extern "C" )?(\w+) (kvshare_\w+)\s*\(([^()]*)\)\s*([{;])', re.M)


C_NAMES = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float"}


def signature(prototype: native.Prototype) -> str:
    """The prototype in C's words: `(int, pointer, int64_t) -> int`."""
    names = ", ".join(C_NAMES.get(argtype, "pointer") for argtype in prototype.argtypes)
    return f"({names}) -> {C_NAMES.get(prototype.restype, prototype.restype.__name__)}"


def definitions() -> dict[str, tuple[str, native.Prototype]]:
    """Every entry point the library's other files define, by name: (the file, its signature
    read as the header's prototypes are). Fails on a file that declares one again."""
    found: dict[str, tuple[str, native.Prototype]] = {}
    for source in OTHER_FILES:
        code = re.sub(r"//[^\n]*", "", source.read_text())
        for restype, name, parameters, end in ENTRY_POINT.findall(code):
            assert end == "{", f"{name}: {source.name} declares it again ({HEADER} does)"
            assert name not in found, f"{name}: defined in {found[name][0]} and {source.name}"
            header = f'extern "C" {{ {restype} {name}({parameters}); }}'
            found[name] = (source.name, native.read_header(header).prototypes[name])
    return found


def test_every_source_includes_the_header_and_copies_none_of_its_constants() -> None:
    copied = re.compile(rf"\b({'|'.join(native.INTERFACE.constants)})\s*=(?!=)")
    for path in OTHER_FILES:
        text = path.read_text()
        if path.suffix == ".cpp":
            assert f'#include "{HEADER}"' in text, f"{path.name} does not include {HEADER}"
        match = copied.search(re.sub(r"//[^\n]*", "", text))
        assert match is None, f"{path.name} defines {match.group(1)}, a constant of {HEADER}"


def test_every_entry_point_is_defined_as_the_header_declares_it() -> None:
    declared, defined = native.INTERFACE.prototypes, definitions()
    assert len(declared) >= 18  # the header was read
    for name in sorted(declared.keys() | defined.keys()):
        assert name in defined, f"{name}: declared in {HEADER}, defined in no source"
        source, definition = defined[name]
        assert name in declared, f"{name}: defined in {source}, not declared in {HEADER}"
        assert definition == declared[name], (
            f"{name}: {source} defines {signature(definition)}, "
            f"{HEADER} declares {signature(declared[name])}"
        )


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_the_loaded_library_binds_every_entry_point_as_declared(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The session's build dir, shared with the other native kernel tests.
    library = native.load_library(tmp_path_factory.getbasetemp() / "native-kernels", "native")
    for name, prototype in native.INTERFACE.prototypes.items():
        bound = getattr(library, name)
        binding = native.Prototype(name, bound.restype, tuple(bound.argtypes or ()))
        assert binding == prototype, (
            f"{name}: bound as {signature(binding)}, {HEADER} declares {signature(prototype)}"
        )


def test_the_python_codes_are_the_headers() -> None:
    constants = native.INTERFACE.constants
    python = {
        "native.DTYPE_CODES[float32]": (native.DTYPE_CODES[torch.float32], "kFloat32"),
        "native.DTYPE_CODES[bfloat16]": (native.DTYPE_CODES[torch.bfloat16], "kBfloat16"),
        "native.CACHE_DTYPE_CODES[float16]": (native.CACHE_DTYPE_CODES[torch.float16], "kFloat16"),
        "block_linear.PANEL_CODE": (block_linear.PANEL_CODE, "kPanelCode"),
        "block_linear.PANEL_COLUMNS": (block_linear.PANEL_COLUMNS, "kLanes"),
        "fused._LANES": (fused._LANES, "kLanes"),
        "decode_step._LANES": (decode_step._LANES, "kLanes"),
    }
    for name, (code, _, _) in block_linear.BLOCK_FORMATS.items():
        python[f"block_linear.BLOCK_FORMATS[{name!r}]"] = (code, f"k{name}")
    for where, (value, constant) in python.items():
        expected = constants[constant]
        assert value == expected, f"{where} is {value}, {HEADER}'s {constant} is {expected}"


@pytest.mark.parametrize(
    ("declaration", "argtypes"),
    [
        ("int kvshare_f(void)", ()),
        ("int kvshare_f()", ()),
        (
            "int kvshare_f(int a, int64_t b, float c)",
            (ctypes.c_int, ctypes.c_int64, ctypes.c_float),
        ),
        ("int kvshare_f(const float* x, int64_t* out)", (ctypes.c_void_p, ctypes.c_void_p)),
        ("int kvshare_f(const char* const* starts,\n  void *p)", (ctypes.c_void_p,) * 2),
    ],
)
def test_the_reader_binds_each_parameter_type(declaration: str, argtypes: tuple) -> None:
    interface = native.read_header(f'constexpr int kA = -3;\nextern "C" {{\n{declaration};\n}}')
    assert interface.constants == {"kA": -3}
    assert interface.prototypes["kvshare_f"] == native.Prototype(
        "kvshare_f", ctypes.c_int, argtypes
    )


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ('extern "C" { int kvshare_f(double x); }', "kvshare_f"),
        ('extern "C" { int kvshare_f(int); }', "kvshare_f"),
        ('extern "C" { float* kvshare_f(int x); }', "kvshare_f"),
        ('extern "C" { int kvshare_f(int x); int kvshare_f(int x); }', "kvshare_f"),
        ('extern "C" { int kvshare_f(int x) { return x; } }', "extern"),
        ('extern "C" { int kvshare_f(int x); }\nextern "C" { int kvshare_g(int x); }', "extern"),
        ('constexpr int kA = kB + 1;\nextern "C" { int kvshare_f(int x); }', "constexpr"),
    ],
)
def test_the_reader_refuses_what_it_cannot_bind(header: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        native.read_header(header)
