"""Every name the CuPy backend takes from CuPy exists in the real CuPy, with the signature it is
called with, on a machine without a GPU.

`scan()` parses (with `ast`, whatever is on disk when the test runs) every module of
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "einpage"
BACKENDS = PACKAGE / "runtime" / "backends"
ROOTS = ("cupy", "cupy_backends")
SKIP = ("no GPU: the real CuPy is the optional extra cupy-check "
        "(pip install -e '.[test,cupy-check]')")

#: what CuPy instance methods return, where the scan cannot see it (keys as the backend
#: spells the class; `X()`: an instance of X)
RETURNS = {
    "cupy.cuda.Stream.record": "cupy.cuda.Event()",
    "cupy.cuda.Stream.end_capture": "cupy.cuda.graph.Graph()",
    "cupy.ndarray.view": "cupy.ndarray()",
    "cupy.ndarray.reshape": "cupy.ndarray()",
    "cupy.ndarray.transpose": "cupy.ndarray()",
}
#: the types of CuPy instance attributes the backend goes through
ATTRIBUTES = {"cupy.ndarray.data": "cupy.cuda.MemoryPointer()"}


# ====================================================================== the scan (no CuPy)

@dataclass(frozen=True)
class Use:
    """A CuPy attribute chain the backend reaches (`path`, symbolic: `X()` is an instance of
    `X`), or a call of one (`nargs` positional arguments and `keywords`; `open_args` when a
    `*args` / `**kwargs` hides them)."""
    file: str
    line: int
    path: str
    text: str
    call: bool = False
    nargs: int = 0
    keywords: tuple[str, ...] = ()
    open_args: bool = False

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


@dataclass(frozen=True)
class ImportUse:
    """An import statement of CuPy as written (`stmt`), run as is in a fresh interpreter."""
    file: str
    line: int
    stmt: str


@dataclass
class _Fn:
    key: str                       # "@module.qualname"
    node: ast.AST
    module: str
    cls: str | None                # "@module.Class" of a method
    params: dict = field(default_factory=dict)   # parameter name -> value (propagated)
    returns: str | None = None


def _modules() -> dict[str, Path]:
    """Module name -> file: the backends, and any einpage module that imports CuPy."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if path.parent == BACKENDS:
            out[name] = path
            continue
        text = path.read_text()
        if re.search(r"^\s*(import|from)\s+(cupy|cupy_backends)\b", text, re.M):
            out[name] = path
    return out


def _is_root(value: str | None) -> bool:
    return value is not None and value.split(".")[0].rstrip("()[]") in ROOTS


class Scan:
    """The fixed point of what is bound to CuPy across the scanned modules; `uses`, `imports`."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.trees: dict[str, ast.Module] = {}
        for name, path in files.items():
            try:
                self.trees[name] = ast.parse(path.read_text(), str(path))
            except SyntaxError as exc:
                raise AssertionError(f"{path} does not parse: {exc}") from None
        self.fns: dict[str, _Fn] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.class_module: dict[str, str] = {}
        self.bases: dict[str, list[str]] = {}
        self.attrs: dict[str, dict[str, str]] = {}    # "@m.Class" -> {attr: value}
        self.module_env: dict[str, dict[str, str]] = {}
        for name, tree in self.trees.items():
            self._index(name, tree)
        for name, tree in self.trees.items():
            self.module_env[name] = self._module_env(name, tree)
        for name, cls in self.classes.items():
            env = self.module_env[self.class_module[name]]
            self.bases[name] = [b for b in (self._resolve(x, env, None) for x in cls.bases)
                                if b is not None and b.startswith("@")]
        self.uses: set[Use] = set()
        self.imports: set[ImportUse] = set()
        for _ in range(8):  # propagation converges in a few rounds
            before = self._state()
            for fn in list(self.fns.values()):
                self._function(fn, record=False)
            if self._state() == before:
                break
        for fn in self.fns.values():
            self._function(fn, record=True)
        for name, tree in self.trees.items():  # module-level statements
            top = [s for s in tree.body
                   if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            self._walk(top, dict(self.module_env[name]), None, name, record=True)

    # ------------------------------------------------------------------ indexing
    def _index(self, module: str, tree: ast.Module) -> None:
        def visit(body, prefix, cls):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"@{module}.{prefix}{node.name}"
                    self.fns[key] = _Fn(key, node, module, cls)
                elif isinstance(node, ast.ClassDef):
                    key = f"@{module}.{prefix}{node.name}"
                    self.classes[key] = node
                    self.class_module[key] = module
                    self.attrs.setdefault(key, {})
                    visit(node.body, f"{prefix}{node.name}.", key)
        visit(tree.body, "", None)

    def _module_env(self, module: str, tree: ast.Module) -> dict[str, str]:
        env = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                env[node.name] = f"@{module}.{node.name}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self._bind_import(node, env, module, record=False)
        return env

    def _bind_import(self, node, env, module, record) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in ROOTS:
                    env[alias.asname or top] = alias.name if alias.asname else top
                    if record:
                        self.imports.add(ImportUse(self._file(module), node.lineno,
                                                   ast.unparse(node)))
            return
        base = node.module or ""
        if node.level:  # relative import inside einpage
            parts = module.split(".")[:-node.level]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            name = alias.asname or alias.name
            if base.split(".")[0] in ROOTS:
                env[name] = f"{base}.{alias.name}"
                if record:
                    self.imports.add(ImportUse(self._file(module), node.lineno,
                                               ast.unparse(node)))
            elif base in self.trees:
                env[name] = f"@{base}.{alias.name}"

    def _file(self, module: str) -> str:
        path = self.files[module]
        return str(path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent)
                   else path)

    def _state(self):
        return (tuple(sorted((k, tuple(sorted(f.params.items())), f.returns)
                             for k, f in self.fns.items())),
                tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.attrs.items())))

    # ------------------------------------------------------------------ values
    def _mro(self, cls: str) -> list[str]:
        out, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if c not in out:
                out.append(c)
                todo += self.bases.get(c, [])
        return out

    def _member(self, base: str, attr: str) -> str | None:
        if base.startswith("@"):
            if not base.endswith("()"):
                return None
            for c in self._mro(base[:-2]):
                if attr in self.attrs.get(c, {}):
                    return self.attrs[c][attr]
                if f"{c}.{attr}" in self.fns:
                    return f"{c}.{attr}"
            return None
        if base.endswith("[]"):
            return None
        if base.endswith("()") and f"{base[:-2]}.{attr}" in ATTRIBUTES:
            return ATTRIBUTES[f"{base[:-2]}.{attr}"]
        return f"{base}.{attr}"

    def _resolve(self, node, env, ctx) -> str | None:
        """The symbolic value of an expression, or None where it is not CuPy's (or unknown)."""
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value, env, ctx)
            return None if base is None else self._member(base, node.attr)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "super" and ctx is not None:
                bases = self.bases.get(ctx, [])
                return f"{bases[0]}()" if bases else None
            fn = self._resolve(node.func, env, ctx)
            return self._call_result(fn)
        if isinstance(node, ast.Subscript):
            base = self._resolve(node.value, env, ctx)
            return base[:-2] if base is not None and base.endswith("[]") else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left = self._resolve(node.left, env, ctx)
            return left if left is not None and left.endswith("MemoryPointer()") else None
        if isinstance(node, ast.DictComp):
            value = self._resolve(node.value, env, ctx)
            return None if value is None else value + "[]"
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            value = self._resolve(node.elt, env, ctx)
            return None if value is None else value + "[]"
        if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
            items = node.values if isinstance(node, ast.Dict) else node.elts
            values = {self._resolve(v, env, ctx) for v in items} - {None}
            return values.pop() + "[]" if len(values) == 1 else None
        if isinstance(node, ast.IfExp):
            return self._resolve(node.body, env, ctx) or self._resolve(node.orelse, env, ctx)
        return None

    def _call_result(self, fn: str | None) -> str | None:
        if fn is None:
            return None
        if fn.startswith("@"):
            if fn in self.classes:
                return fn + "()"
            f = self.fns.get(fn)
            return f.returns if f is not None else None
        if fn.endswith("()") or fn.endswith("[]"):
            return None
        head, _, attr = fn.rpartition(".")
        if head.endswith("()"):  # an instance's method
            return RETURNS.get(f"{head[:-2]}.{attr}")
        return fn + "()"

    # ------------------------------------------------------------------ bodies
    def _function(self, fn: _Fn, record: bool) -> None:
        env = dict(self.module_env[fn.module])
        args = fn.node.args
        positional = args.posonlyargs + args.args
        is_method = fn.cls is not None and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.node.decorator_list)
        if is_method and positional:
            env[positional[0].arg] = fn.cls + "()"
        for p, value in fn.params.items():
            env.setdefault(p, value)
        self._walk(fn.node.body, env, fn.cls, fn.module, record, fn)

    def _walk(self, body, env, cls, module, record, fn: _Fn | None = None) -> None:
        nodes = [n for stmt in body for n in ast.walk(stmt)]
        for _ in range(4):  # assignments in any order (flow-insensitive)
            before = dict(env)
            for node in nodes:
                self._assign(node, env, cls, module)
            if env == before:
                break
        for node in nodes:
            if isinstance(node, ast.Call):
                self._propagate(node, env, cls)
            if fn is not None and isinstance(node, ast.Return) and node.value is not None:
                value = self._resolve(node.value, env, cls)
                if value is not None and fn.returns is None:
                    fn.returns = value
        if record:
            for node in nodes:
                self._record(node, env, cls, module)

    def _assign(self, node, env, cls, module) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._bind_import(node, env, module, record=False)
            return
        pairs = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs.append((node.target, node.value))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((node.optional_vars, node.context_expr))
        for target, value_node in pairs:
            value = self._resolve(value_node, env, cls)
            if value is None:
                continue
            if isinstance(target, ast.Name):
                env.setdefault(target.id, value)
            elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                  and cls is not None and env.get(target.value.id) == cls + "()"):
                self.attrs[cls].setdefault(target.attr, value)

    def _propagate(self, node: ast.Call, env, cls) -> None:
        fn_value = self._resolve(node.func, env, cls)
        if fn_value is None or not fn_value.startswith("@"):
            return
        skip_self = True
        if fn_value in self.classes:
            fn_value = next((f"{c}.__init__" for c in self._mro(fn_value)
                             if f"{c}.__init__" in self.fns), None)
            if fn_value is None:
                return
        target = self.fns.get(fn_value)
        if target is None:
            return
        if target.cls is None:
            skip_self = False
        params = [a.arg for a in target.node.args.posonlyargs + target.node.args.args]
        if skip_self:
            params = params[1:]
        for p, arg in zip(params, node.args):
            if isinstance(arg, ast.Starred):
                break
            value = self._resolve(arg, env, cls)
            if value is not None:
                target.params.setdefault(p, value)
        names = set(params) | {a.arg for a in target.node.args.kwonlyargs}
        for kw in node.keywords:
            if kw.arg in names:
                value = self._resolve(kw.value, env, cls)
                if value is not None:
                    target.params.setdefault(kw.arg, value)

    def _record(self, node, env, cls, module) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._bind_import(node, {}, module, record=True)
            return
        file = self._file(module)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value, env, cls)
            if _is_root(base) and not base.endswith("[]"):
                self.uses.add(Use(file, node.lineno, f"{base}.{node.attr}", ast.unparse(node)))
        elif isinstance(node, ast.Call):
            fn = self._resolve(node.func, env, cls)
            if fn is not None and fn.endswith("()"):  # calling an instance
                fn += ".__call__"
            if _is_root(fn):
                open_args = (any(isinstance(a, ast.Starred) for a in node.args)
                             or any(k.arg is None for k in node.keywords))
                self.uses.add(Use(file, node.lineno, fn, ast.unparse(node.func) + "(...)", True,
                                  len(node.args), tuple(k.arg for k in node.keywords
                                                        if k.arg is not None), open_args))


def scan() -> Scan:
    return Scan(_modules())


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
    importing = {str(path.relative_to(PACKAGE.parent)) for path in _modules().values()
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
    for name, path in _modules().items():
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
    for name, path in _modules().items():
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
