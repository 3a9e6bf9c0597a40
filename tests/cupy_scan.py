"""The scan behind `tests/test_cupy_api.py`: every module of `einpage/runtime/backends/` and any
other `einpage` module that imports CuPy, parsed with `ast` (whatever is on disk when the test
runs), and what is bound to CuPy followed through it: the modules themselves (`import cupy`,
`import cupy as cp`, `from cupy.cuda import ...`, `cupy_backends...`), names and attributes
assigned from them, arguments passed to the backend's own functions and classes, what they
return, and instances of CuPy classes. Each attribute chain reached is a `Use`; needs no CuPy."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "einpage"
BACKENDS = PACKAGE / "runtime" / "backends"
ROOTS = ("cupy", "cupy_backends")

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


def scanned_modules() -> dict[str, Path]:
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
    return Scan(scanned_modules())
