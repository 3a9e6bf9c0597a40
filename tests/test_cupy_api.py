"""Every name the CuPy backend takes from CuPy exists in the real CuPy, with the signature it is
called with, on a machine without a GPU.

`scan()` (`tests/cupy_scan.py`) parses (with `ast`, whatever is on disk when the test runs) every module of
`einpage/runtime/backends/` and any other `einpage` module that imports CuPy, and follows what
is bound to CuPy: the modules themselves (`import cupy`, `import cupy as cp`, `from cupy.cuda
import ...`, `cupy_backends...`), names and attributes assigned from them (`self._cp = cupy`,
`cp = self._cp`), arguments passed to the backend's own functions and classes (`self.xp` of
`MatmulOps` is `backend._cp`, a parameter passed `cupy.cuda.cublas` is CuPy's cuBLAS module),
what they return, and instances of CuPy classes (a `Stream`, its `record()` Event, an ndarray's
`data` pointer). Each attribute chain reached is then looked up in the installed CuPy and each
call bound to the callee's signature (from `inspect`, or the first line of a Cython docstring).

Without the real CuPy (the optional extra `cupy-check`: `pip install -e '.[test,cupy-check]'`)
the checks against it skip; the scan itself is tested everywhere.
"""
from __future__ import annotations

import ast
import ctypes
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import pytest
from cupy_scan import PACKAGE, Scan, Use, scan, scanned_modules

SKIP = ("no GPU: the real CuPy is the optional extra cupy-check "
        "(pip install -e '.[test,cupy-check]')")


@pytest.fixture(scope="module")
def scanned() -> Scan:
    return scan()


# ====================================================================== the scan, everywhere

def test_scan_follows_cupy_through_the_backend(scanned):
    """The scan reaches CuPy through every way the backend binds it (so the checks below see
    the backend's names): the module, `self._cp`, `cp` parameters, `self.xp` of the GEMM ops,
    instances (streams, events)."""
    paths = {u.path for u in scanned.uses}
    assert len(paths) >= 20, sorted(paths)
    for expected in ("cupy.ElementwiseKernel", "cupy.ReductionKernel", "cupy.cuda.Stream",
                     "cupy.cuda.Event", "cupy.ndarray", "cupy.cuda.Memory"):
        assert expected in paths, f"the scan lost {expected}: {sorted(paths)}"
    assert any(p.startswith("cupy.cuda.Stream().") for p in paths), sorted(paths)
    files = {u.file for u in scanned.uses}
    importing = {str(path.relative_to(PACKAGE.parent)) for path in scanned_modules().values()
                 if re.search(r"^\s*(import|from)\s+(cupy|cupy_backends)\b", path.read_text(),
                              re.M)}
    assert importing and importing <= files, (importing - files)


def test_scan_binds_names_assignments_calls_and_instances(tmp_path):
    """The scan on a small module: each binding form is followed, and nothing else is."""
    mod = tmp_path / "einpage" / "runtime" / "backends"
    mod.mkdir(parents=True)
    (mod / "fake.py").write_text('''
import numpy as np
from cupy_backends.cuda.api import runtime

def use(cublas, handle):
    cublas.gemmEx(handle, *range(18))

class Ops:
    def __init__(self, xp):
        self.xp, self.n = xp, 1
    def run(self):
        self.xp.copyto(1, 2, casting="unsafe")

class Backend:
    def __init__(self):
        import cupy as cp
        self._cp = cp
        self._streams = {q: cp.cuda.Stream(non_blocking=True) for q in "ab"}
    def ptr(self):
        return self._cp.cuda.MemoryPointer(None, 0)
    def go(self, x):
        cp = self._cp
        Ops(cp).run()
        use(cp.cuda.cublas, 0)
        self._streams["a"].record().synchronize()
        (self.ptr() + 8).memset_async(0, 8)
        np.zeros(3).tolist()
        x.whatever()
        runtime.memGetInfo()
''')
    s = Scan({"einpage.runtime.backends.fake": mod / "fake.py"})
    paths = {u.path for u in s.uses}
    for p in ("cupy.cuda.cublas.gemmEx", "cupy.copyto", "cupy.cuda.Stream",
              "cupy.cuda.Stream().record", "cupy.cuda.Event().synchronize",
              "cupy.cuda.MemoryPointer().memset_async",
              "cupy_backends.cuda.api.runtime.memGetInfo"):
        assert p in paths, (p, sorted(paths))
    assert not any("tolist" in p or "whatever" in p for p in paths)
    calls = {u.path: u for u in s.uses if u.call}
    assert calls["cupy.cuda.cublas.gemmEx"].open_args
    assert calls["cupy.copyto"].keywords == ("casting",) and calls["cupy.copyto"].nargs == 2
    assert {i.stmt for i in s.imports} == {"from cupy_backends.cuda.api import runtime",
                                           "import cupy as cp"}


# ====================================================================== against the real CuPy

@pytest.fixture(scope="module")
def cupy():
    try:
        import cupy
    except Exception as exc:  # not installed, or built for another CUDA
        if importlib.util.find_spec("cupy") is not None:
            raise AssertionError(f"CuPy is installed but does not import: {exc}") from exc
        pytest.skip(SKIP)
    return cupy


class InstanceAttributeUnknown(AttributeError):
    """An attribute not on the class of an instance that has a `__dict__`: it may be set in
    `__init__` (as `PinnedMemory.ptr` is), so only a call of it is known to be wrong."""


def _sample(cls):
    """An instance of a CuPy class made without a driver, where one can be (its instance
    attributes set in `__init__` are then visible), or None."""
    import cupy
    makers = {cupy.cuda.Stream: lambda: cupy.cuda.Stream.null,
              cupy.cuda.PinnedMemory: lambda: cupy.cuda.PinnedMemory(0)}
    make = makers.get(cls)
    try:
        return make() if make is not None else None
    except Exception:  # noqa: BLE001 - a CUDA error: no sample here
        return None


def _lookup(path: str):
    """The object a symbolic path names in the installed CuPy: (object, bound through an
    instance). Raises AttributeError (with the missing prefix) where it does not exist;
    returns (None, ...) where the path goes through a value whose type is unknown (a
    function's result, an instance's data attribute)."""
    segments = path.split(".")
    root = segments[0].rstrip("()[]")
    obj = importlib.import_module(root)
    done, via_instance = [root], False
    for seg in segments[1:]:
        if done[-1].endswith("[]"):
            return None, via_instance
        name = seg.rstrip("()[]")
        prev_instance = done[-1].endswith("()")
        if prev_instance and not isinstance(obj, type):
            return None, via_instance  # a function's result: unknown
        if via_instance and not (inspect.isroutine(obj) or isinstance(obj, type)):
            return None, via_instance  # an instance's data attribute: its type is unknown
        try:
            nxt = getattr(obj, name)
        except AttributeError:
            nxt = missing = object()
            if inspect.ismodule(obj):
                try:
                    nxt = importlib.import_module(f"{obj.__name__}.{name}")
                except ImportError:
                    pass
            if nxt is missing and prev_instance and isinstance(obj, type):
                sample = _sample(obj)
                if sample is not None and hasattr(sample, name):
                    nxt = getattr(sample, name)
                elif sample is None and obj.__dictoffset__:
                    raise InstanceAttributeUnknown(
                        f"{'.'.join(done)} has no attribute {name!r}") from None
            if nxt is missing:
                raise AttributeError(f"{'.'.join(done)} has no attribute {name!r}") from None
        obj, via_instance = nxt, prev_instance
        done.append(seg)
    return obj, via_instance


_DOC_SIG = re.compile(r"^\s*[\w.]+\((.*)\)\s*(->.*)?$")


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out if p.strip()]


def signature(obj) -> inspect.Signature | None:
    """A callable's signature: from `inspect`, else from the first docstring line Cython
    embeds (`name(size_t size, stream=None)`: C types dropped)."""
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    match = _DOC_SIG.match(doc[0]) if doc else None
    if match is not None:
        params, seen_default = [], False
        for part in _split_params(match.group(1)):
            if part in ("*", "/"):
                continue
            left, eq, _ = part.replace("\\", "").partition("=")
            words = left.replace("*", " * ").split()
            name = words[-1]
            if left.strip().startswith("**"):
                params.append(inspect.Parameter(name, inspect.Parameter.VAR_KEYWORD))
            elif left.strip().startswith("*"):
                params.append(inspect.Parameter(name, inspect.Parameter.VAR_POSITIONAL))
            else:
                seen_default = seen_default or bool(eq)
                default = None if eq else inspect.Parameter.empty
                kind = (inspect.Parameter.KEYWORD_ONLY
                        if any(p.kind == p.VAR_POSITIONAL for p in params)
                        else inspect.Parameter.POSITIONAL_OR_KEYWORD)
                params.append(inspect.Parameter(name, kind, default=default))
        try:
            return inspect.Signature(params)
        except ValueError:
            pass
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _binds(sig: inspect.Signature, use: Use, via_instance: bool, is_class: bool):
    """None where the call fits the signature, else why not."""
    params = list(sig.parameters.values())
    nargs = use.nargs
    if via_instance and params and params[0].name in ("self", "cls"):
        nargs += 1  # a method looked up on the class: its self
    elif is_class and params and params[0].name == "self":
        params = params[1:]
        sig = sig.replace(parameters=params)
    try:
        sig.bind(*([None] * nargs), **{k: None for k in use.keywords})
    except TypeError as exc:
        return f"{exc} (signature {sig})"
    return None


def check(scanned: Scan):
    """(problems, names checked, calls without a visible signature, instance attributes that
    cannot be checked) of the uses of a scan, against the installed CuPy."""
    problems, checked, unsigned, unverifiable = [], 0, [], []
    called = {u.path for u in scanned.uses if u.call}
    missing = set()  # (file, line, path): an attribute and its call are one problem
    for use in sorted(scanned.uses, key=lambda u: (u.file, u.line, u.path, u.call)):
        key = (use.file, use.line, use.path)
        try:
            obj, via_instance = _lookup(use.path)
        except InstanceAttributeUnknown as exc:
            if use.path not in called:
                unverifiable.append(use.path)
            elif key not in missing:
                problems.append(f"{use.where()}: {exc} (and it is called)")
            missing.add(key)
            continue
        except AttributeError as exc:
            if key not in missing:
                problems.append(f"{use.where()}: {exc}")
            missing.add(key)
            continue
        if obj is None or not use.call:
            checked += not use.call
            continue
        if use.open_args:
            continue
        sig = signature(obj)
        if sig is None:
            unsigned.append(use.path)
            continue
        why = _binds(sig, use, via_instance, isinstance(obj, type))
        checked += 1
        if why is not None:
            problems.append(f"{use.where()}: {use.path} called with {use.nargs} positional "
                            f"and keywords {use.keywords}: {why}")
    return problems, checked, sorted(set(unsigned)), sorted(set(unverifiable))


def test_every_name_the_backend_takes_from_cupy_exists(cupy, scanned):
    """Each attribute chain exists, and each call binds to the callee's signature."""
    problems, checked, unsigned, unverifiable = check(scanned)
    assert not problems, "names or calls the real CuPy does not have:\n" + "\n".join(problems)
    assert checked >= 20, checked
    print(f"checked {checked} CuPy names and calls from {len({u.file for u in scanned.uses})} "
          f"modules; no signature visible for {unsigned}; instance attributes not on their "
          f"class (set in __init__?): {unverifiable}")


def test_the_check_catches_wrong_names_and_calls(cupy, tmp_path):
    """Misspelt names, unknown keywords and wrong arities, in each way the backend binds
    CuPy, are reported; the right spellings are not."""
    mod = tmp_path / "wrong.py"
    mod.write_text('''
import cupy

def issue(cublas):
    cublas.gemmEx(1, 2, 3)

class Backend:
    def __init__(self):
        self._cp = cupy
    def go(self):
        cp = self._cp
        s = cp.cuda.Stream(nonblocking=True)
        s.synchronise()
        cp.cuda.Event(block=True, disable_timing=True).record(s)
        cp.cuda.runtime.memGetInfos()
        issue(cp.cuda.cublas)
        cp.cuda.Stream(non_blocking=True).begin_capture()
''')
    problems, _, _, _ = check(Scan({"einpage.runtime.backends.wrong": mod}))
    text = "\n".join(problems)
    for wrong in ("gemmEx called with 3 positional", "unexpected keyword argument 'nonblocking'",
                  "no attribute 'synchronise'", "no attribute 'memGetInfos'"):
        assert wrong in text, (wrong, text)
    assert len(problems) == 4, text


def test_the_backends_cupy_imports_work_without_a_driver(cupy, scanned):
    """Each CuPy import statement of the backend, as written, runs in a fresh interpreter (a
    dotted `import cupy_backends.cuda.libs.cublas` would fail: CuPy loads libcublas only
    through the `cupy_backends.cuda.libs` package's attribute hook)."""
    assert scanned.imports
    for stmt in sorted({i.stmt for i in scanned.imports}):
        result = subprocess.run([sys.executable, "-c", stmt], capture_output=True, text=True)
        where = [f"{i.file}:{i.line}" for i in scanned.imports if i.stmt == stmt]
        assert result.returncode == 0, f"{stmt!r} ({where}) fails: {result.stderr[-2000:]}"


def test_signatures_the_backend_relies_on(cupy):
    """The calls that matter, where Python can see them (no GPU: constructors that reach the
    driver are only bound, not called)."""
    def binds(obj, *args, **kwargs):
        sig = signature(obj)
        assert sig is not None, obj
        sig.bind(*args, **kwargs)
        return sig

    k = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x", "ep_check",
                               options=("--std=c++17", "--fmad=false"), no_return=True)
    assert k.no_return and k.kwargs == {"options": ("--std=c++17", "--fmad=false")}
    r = cupy.ReductionKernel("float32 x, int32 n", "float32 y", "x", "a + b", "y = a", "0",
                             "ep_check_r", reduce_type="float", preamble="",
                             options=("--fmad=false",))
    assert r.options == ("--fmad=false",)
    binds(cupy.cuda.Stream, non_blocking=True)
    binds(cupy.cuda.Event, block=True, disable_timing=True)
    binds(cupy.cuda.Event.record, None, None)
    binds(cupy.cuda.runtime.memGetInfo)
    binds(cupy.cuda.Stream.begin_capture, None)
    binds(cupy.cuda.Stream.end_capture, None)
    binds(cupy.cuda.Stream.launch_host_func, None, print, None)
    assert hasattr(cupy.cuda.graph.Graph, "launch") and hasattr(cupy.cuda.graph.Graph, "upload")
    binds(cupy.cuda.graph.Graph.launch, None, stream=None)
    cublas = cupy.cuda.cublas
    assert len(signature(cublas.gemmEx).parameters) == 19
    assert len(signature(cublas.gemmStridedBatchedEx).parameters) == 23
    binds(cupy.cuda.UnownedMemory, 0, 1, None, 0)
    binds(cupy.cuda.MemoryPointer, None, 0)
    binds(cupy.cuda.MemoryPointer.copy_from_host_async, None, 0, 8, None)
    binds(cupy.cuda.MemoryPointer.copy_to_host_async, None, 0, 8, None)
    binds(cupy.cuda.MemoryPointer.memset_async, None, 0, 8, None)
    binds(cupy.cuda.PinnedMemory, 8)
    assert cupy.cuda.PinnedMemory(0).ptr == 0  # set in __init__; size 0 reaches no driver
    binds(cupy.cuda.using_allocator, None)
    binds(cupy.cuda.get_elapsed_time, None, None)
    # the plan's copies (a captured pass too: CuPy's copy_*_async refuse a capturing stream)
    binds(cupy.cuda.runtime.memcpyAsync, 0, 0, 8, cupy.cuda.runtime.memcpyHostToDevice, 0)
    assert (cupy.cuda.runtime.memcpyHostToDevice, cupy.cuda.runtime.memcpyDeviceToHost) == (1, 2)


def test_the_backends_kernels_are_cupy_kernels_with_its_options(cupy):
    """Every kernel of the tiny models' plans, made by the backend's own `compiled` with the
    real CuPy: CuPy parses its parameters, and it carries `NVRTC_OPTIONS`."""
    import nvrtc

    from einpage.runtime.backends import cuda_apply
    from einpage.runtime.backends.cuda_source import NVRTC_OPTIONS, ElementwiseSource
    sources = {k[0]: v[0] for found in nvrtc.family_kernels().values()
               for k, v in found.items()}
    cuda_apply.KERNELS.clear()
    try:
        for src in sources.values():
            kernel = cuda_apply.compiled(src)
            assert isinstance(kernel, (cupy.ElementwiseKernel, cupy.ReductionKernel))
            options = (kernel.kwargs.get("options", ()) if isinstance(src, ElementwiseSource)
                       else kernel.options)
            assert tuple(options) == tuple(NVRTC_OPTIONS), (src.name, options)
            params = kernel.params if isinstance(src, ElementwiseSource) else kernel._params
            ours = nvrtc.parse_params(src.in_params, True) + nvrtc.parse_params(src.out_params,
                                                                               False)
            assert [(p.name, p.ctype, p.raw, p.is_const) for p in params][:len(ours)] == \
                [(p.name, p.ctype, p.raw, p.is_const) for p in ours]
    finally:
        cuda_apply.KERNELS.clear()


def _constants() -> dict[str, tuple[str, int]]:
    """Module-level integer constants of the scanned modules named as CUDA's (`CUBLAS_*`,
    `CUDA_R_*`): name -> (where, value)."""
    out = {}
    for name, path in scanned_modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts)
                         if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(target, node.value)])
                for t, v in pairs:
                    if (isinstance(t, ast.Name) and re.match(r"(CUBLAS|CUDA_R)_", t.id)
                            and isinstance(v, (ast.Constant, ast.UnaryOp))):
                        try:
                            value = ast.literal_eval(v)
                        except ValueError:
                            continue
                        if isinstance(value, int):
                            out[t.id] = (f"{path.relative_to(PACKAGE.parent)}:{node.lineno}",
                                         value)
    return out


def test_the_backends_cuda_constants_are_cupys(cupy):
    """cuBLAS and CUDA data-type constants the backend spells itself equal CuPy's (CuPy's
    `gemmEx` takes the CUDA 11+ compute types, `CUBLAS_COMPUTE_*` >= 64)."""
    constants = _constants()
    compared = 0
    for name, (where, value) in sorted(constants.items()):
        for module in (cupy.cuda.cublas, cupy.cuda.runtime):
            if hasattr(module, name):
                assert getattr(module, name) == value, (where, name, value,
                                                        getattr(module, name))
                compared += 1
                break
        if name.startswith("CUBLAS_COMPUTE_"):
            assert value >= cupy.cuda.cublas.CUBLAS_COMPUTE_16F, (where, name, value)
    if constants:
        assert compared, constants


_C_SIZES = {"intptr_t": 8, "size_t": 8, "int": 4, "unsigned int": 4, "long long": 8,
            "float": 4, "double": 8}


def _cupy_prototype(cupy, symbol: str):
    """[(C type, name)] of CuPy's wrapper of a cuBLAS function (`cublasGemmEx_v2` ->
    `cupy.cuda.cublas.gemmEx`), from its Cython signature line, or None."""
    name = symbol.removeprefix("cublas")
    name = name.removesuffix("_v2")
    wrapper = getattr(cupy.cuda.cublas, name[:1].lower() + name[1:], None)
    doc = (getattr(wrapper, "__doc__", None) or "").strip().splitlines()
    match = _DOC_SIG.match(doc[0]) if doc else None
    if match is None:
        return None
    out = []
    for part in _split_params(match.group(1)):
        words = part.partition("=")[0].split()
        out.append((" ".join(words[:-1]), words[-1]))
    return out


def test_the_cublas_functions_the_backend_calls_through_ctypes(cupy):
    """cuBLAS functions the backend calls itself (ctypes, on the libcublas CuPy loaded, found
    as the backend finds it) exist there, and the `argtypes` it gives them have the sizes of
    the C prototype, as CuPy's own wrapper declares it (a wrong one corrupts the call)."""
    cupy.cuda.cublas  # loads libcublas (through cuda.pathfinder), as a cuBLAS handle would
    seen = 0
    for name, path in scanned_modules().items():
        text = path.read_text()
        tree = ast.parse(text)
        symbols = {n.attr for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and re.match(r"cublas[A-Z]", n.attr)}
        loaders = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                   and "libcublas" in (ast.get_source_segment(text, n) or "")
                   and len(n.args.args) == len(n.args.defaults)]  # callable with no argument
        if not symbols or not loaders:
            continue
        module = importlib.import_module(name)
        for loader in loaders:
            lib = getattr(module, loader)()
            assert isinstance(lib, ctypes.CDLL), (path, loader, lib)
            missing = [s for s in sorted(symbols) if not hasattr(lib, s)]
            assert not missing, f"{path}: {loader}() ({lib._name}) lacks {missing}"
            for symbol in sorted(symbols):
                argtypes = getattr(lib, symbol).argtypes
                proto = _cupy_prototype(cupy, symbol)
                if argtypes is None or proto is None:
                    continue
                sizes = [ctypes.sizeof(a) for a in argtypes]
                want = [_C_SIZES.get(ctype) for ctype, _ in proto]
                assert len(sizes) == len(want) and all(
                    w is None or s == w for s, w in zip(sizes, want)), (
                    f"{path}: {symbol}.argtypes sizes {sizes} != the prototype's {want} "
                    f"({proto})")
                seen += 1
    print(f"{seen} ctypes cuBLAS prototypes checked against CuPy's wrappers")
