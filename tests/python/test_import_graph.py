"""The package's shape, read from its source with ast (nothing is imported):

1. No import circle among the modules of python/statepager. An edge A -> B is any import
   statement in A, at module level or inside a function (lazy imports count: they are
   circles all the same, merely deferred), naming module B: `import statepager.B`,
   `from statepager.B import x`, `from statepager import B` (when B is a module), and
   the relative forms. The edges a package's __init__ implies (importing
   statepager.core.pager runs statepager/__init__.py) are not counted: every module would
   be in a circle with the package that re-exports it. The C++ extension statepager._C
   imports nothing of the package and is a leaf.

2. No module reads or writes another's private names. In module M:
   - `from statepager.X import _name` (X another module) is a violation, except for the
     package-private modules _C (the extension, the binding every layer uses) and _build;
   - an attribute access `expr._name` (one leading underscore; dunders are Python's) is
     a violation unless M itself defines `_name`: as a module-level or class-body name, a
     function or class it defines (at any depth), or an attribute that a method of one of
     its classes assigns on self or cls (`self._name = ...`). Writes count as uses:
     `pager._saving = h` in a module that does not define `_saving` is a violation, and
     so is `self._x` of an attribute that only a base class in another module defines.
   The check goes by name, not by type: a module that defines `_core` itself could read
   another object's `_core` unnoticed (none does; reviewers look for it).
   The few private names of other libraries that statepager must use (torch's LR
   scheduler protocol, Megatron internals) are allowed in exactly one module each, by
   name, in FOREIGN below, with the reason.

3. Imports point down the package's layers (LAYERS): a module imports modules of its
   own layer or of layers below, never above. Within a layer, rule 1 keeps it free of
   circles.

4. No module of the package is over 500 lines, and no class over 400: past that, a unit
   holds more than one concept and splits.

Each check is run on planted examples too, so that this test can fail.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "python"
PACKAGE = "statepager"
EXTENSION = f"{PACKAGE}._C"
PACKAGE_PRIVATE = {"_C", "_build"}

# The package's layers, lowest first: a module's layer is that of the longest prefix
# named here. The extension and the build helper are the floor every layer stands on.
LAYERS = [
    ("statepager._C", "statepager._build"),  # the C++ core, and how it is loaded
    ("statepager.util",),          # tensors, ranks, units, names: imports nothing above
    ("statepager.formats",),       # stored formats and their codecs
    ("statepager.core",),          # Pager, the streamed step, scope, state access
    ("statepager.checkpoint",),    # functions over a Pager's public interface
    ("statepager.integrations",    # Megatron-core's optimizers, Megatron-LM's script,
     "statepager.memory_saver"),   # torch_memory_saver's API over Pagers
    ("statepager",),               # the package's public names (statepager/__init__.py)
    ("statepager.tools",),         # the command line, doctor, inspect, bench
    ("statepager.__main__", "statepager.megatron_lm"),  # entry points of python -m
]
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 400

# Private names of other libraries, allowed in one module each: {module: {name: why}}.
FOREIGN = {
    "statepager.core.optimizer_methods": {
        "_opt_called": "torch's LR schedulers check this flag to see that step() ran",
        "_wrapped_by_lr_sched": "torch's LR schedulers mark the step they wrapped so",
    },
    "statepager.core.state_dict": {
        "_optimizer_load_state_dict_pre_hooks": "torch's load_state_dict hooks, run once",
        "_optimizer_load_state_dict_post_hooks": "torch's load_state_dict hooks, run once",
    },
    "statepager.core.serial": {
        "_is_owned": "threading.RLock has no public test of whether this thread holds it",
    },
    "statepager.core.guard": {
        "_untyped_storage": "a TypedStorage's bytes: its public untyped() warns that "
                            "TypedStorage is deprecated, from inside a repr",
    },
    "statepager.core.support": {
        "_init_group": "torch's Adam creates its state here: whether it is torch's own",
    },
    "statepager.core.scope": {
        "_to_copy": "the aten op (torch.ops.aten._to_copy) that .to() allocates through",
        "_apply": "torch.nn.Module._apply, recognized on the stack (its code object)",
        "_getframe": "sys._getframe, to walk that stack",
    },
    "statepager.tools.bench.step": {
        "_fused_adamw_": "torch._fused_adamw_, the floor of the step bench",
        "_statepager_mmap": "keeps the mmap under a torch.frombuffer tensor alive",
    },
    "statepager.core.fused_adamw": {
        "_foreach_add": "torch._foreach_add, the step counts as _multi_tensor_adam advances them",
    },
    "statepager.util.warn": {
        "_getframe": "sys._getframe, to find the user's frame a warning points at",
    },
    "statepager.util.streams": {
        "_C": "torch._C, where that accessor lives",
        "_cuda_getCurrentRawStream": "torch's raw current stream (its compiled code's): the "
                                     "public torch.cuda.current_stream makes a Stream per call",
    },
    "statepager.util.flat": {
        "_foreach_copy_": "torch._foreach_copy_, many copies as one (copy_each)",
        "_foreach_zero_": "torch._foreach_zero_, many zero fills as one (zero_each)",
    },
    "statepager.tools.bench.tms": {
        "_exit": "os._exit: the child skips teardown, which torch-memory-saver aborts",
    },
    "statepager.tools.bench.megatron_worker": {  # tms runs as a script of its own: no shared helper
        "_exit": "os._exit: a failed worker skips teardown, which torch aborts on a "
                 "CUDA context a device error broke",
    },
    "statepager.integrations.megatron_internals": {
        "_get_model_param_range_map": "Megatron: a param's range in its DDP bucket",
        "_build_model_param_to_state_dict_param_map": "Megatron: reload_model_params",
        "_get_param_grad_norm_group": "Megatron: which grad norm a param counts in",
        "_copy_model_grads_to_main_grads": "Megatron's DistributedOptimizer hook",
        "_copy_main_params_to_model_params": "Megatron's DistributedOptimizer hook",
        "_copy_model_params_to_main_params": "Megatron's DistributedOptimizer hook",
        "_get_main_param_and_optimizer_states": "Megatron: every checkpoint format's read",
        "_set_main_param_and_optimizer_states": "Megatron: every checkpoint format's write",
    },
}


def modules(root: pathlib.Path = ROOT) -> dict[str, ast.Module]:
    """{dotted name: parsed source} of every module of the package under root."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        tree = ast.parse(path.read_text(), str(path))
        tree.is_package = is_package
        out[name] = tree
    return out


def _absolute(module: str, tree: ast.Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not tree.is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, tree: ast.Module, known: set) -> set[str]:
    """Modules of the package that `module` imports anywhere in its source."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, tree, node)
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known | {EXTENSION}
                     else source for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != module}
    return out


def circles(graph: dict[str, set]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined(tree: ast.Module) -> set[str]:
    """Private names the module defines: its functions, classes, module and class-body
    names, and attributes that methods of its classes assign on self or cls (an
    assignment to another object's private attribute is a write into it, not a
    definition; so is one on `self` in a function that is no method)."""
    out = set()
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {sub.id for sub in ast.walk(t)
                        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)}
        if id(node) in methods:
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")):
                    out.add(sub.attr)
    return {n for n in out if _private(n)}


def private_uses(module: str, tree: ast.Module, known: set) -> list[str]:
    """Violations of rule 2 in `module`, as 'module:line: what'."""
    own = defined(tree) | set(FOREIGN.get(module, {}))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, tree, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                if _private(a.name) and a.name not in PACKAGE_PRIVATE:
                    out.append(f"{module}:{node.lineno}: imports {source}.{a.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in own:
                out.append(f"{module}:{node.lineno}: uses .{node.attr}, which it does not "
                           "define")
    return out


def check(root: pathlib.Path = ROOT) -> tuple[list, list]:
    trees = modules(root)
    known = set(trees)
    graph = {m: imports(m, t, known) for m, t in trees.items()}
    private = [v for m, t in trees.items() for v in private_uses(m, t, known)]
    return circles(graph), private


def layer(module: str) -> int:
    """The index in LAYERS of the longest prefix of `module` it names."""
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    assert found is not None, f"{module} is in no layer of LAYERS"
    return found


def upward(graph: dict[str, set]) -> list[str]:
    """Each import of a module in a higher layer, as 'importer -> imported'."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if layer(d) > layer(m))


def oversized(root: pathlib.Path = ROOT) -> list[str]:
    """Files over MAX_FILE_LINES and classes over MAX_CLASS_LINES, as 'path: what'."""
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root)
        if text.count("\n") > MAX_FILE_LINES:
            out.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    out.append(f"{rel}: class {node.name} of {n} lines")
    return out


def graph_of(root: pathlib.Path = ROOT) -> dict[str, set]:
    trees = modules(root)
    return {m: imports(m, t, set(trees)) for m, t in trees.items()}


def test_imports_point_down_the_layers():
    assert upward(graph_of()) == []


def test_no_unit_outgrows_one_concept():
    assert oversized() == []


def test_no_import_circle_and_no_private_access():
    found_circles, private = check()
    assert found_circles == [], f"import circles: {found_circles}"
    assert private == [], "private names used across modules:\n" + "\n".join(private)


def test_every_module_is_seen():
    names = set(modules())
    for m in ("statepager", "statepager.core.pager", "statepager.core.binding",
              "statepager.checkpoint.save_load", "statepager.integrations.megatron"):
        assert m in names
    for m in names:
        layer(m)  # every module is in a layer


def _plant(tmp_path, files: dict) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_check_finds_a_lazy_import_circle(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "from statepager.core import b\n",
        # a function-level import closes the circle a -> b -> c -> a
        "core/b.py": "def f():\n    from statepager.core.c import g\n    return g\n",
        "core/c.py": "def g():\n    from . import a\n",
        "core/d.py": "from statepager import _C\nimport statepager.core.a\n",
    })
    found, private = check(root)
    assert found == [["statepager.core.a", "statepager.core.b", "statepager.core.c"]]
    assert private == []


def test_the_check_finds_private_access(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "pager.py": ("class Pager:\n    _saving = None\n"
                     "    def __init__(self):\n        self._core = 1\n"
                     "    def other(self, p):\n        return p._core\n"
                     "def _rank():\n    return 0\n"),
        "checkpoint.py": ("from statepager.pager import _rank\n"
                          "def save(pager):\n    pager._saving = pager._core\n"
                          "    return pager.__class__, _rank()\n"),
    })
    found, private = check(root)
    assert found == []
    assert private == [
        "statepager.checkpoint:1: imports statepager.pager._rank",
        "statepager.checkpoint:3: uses ._saving, which it does not define",
        "statepager.checkpoint:3: uses ._core, which it does not define",
    ]


def test_the_check_finds_an_import_up_the_layers(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "util/__init__.py": "", "core/__init__.py": "", "checkpoint/__init__.py": "",
        "util/flat.py": "from statepager import _C\n",
        "checkpoint/save.py": "from statepager.core import pager\n",
        # a lazy import from the core up to the checkpoint layer
        "core/pager.py": "def save():\n    from statepager.checkpoint import save\n",
    })
    assert upward(graph_of(root)) == ["statepager.core.pager -> statepager.checkpoint.save"]


def test_the_check_finds_oversized_units(tmp_path):
    body = "    x = 1\n" * MAX_CLASS_LINES
    root = _plant(tmp_path, {
        "__init__.py": "",
        "big.py": "class Big:\n" + body,
        "long.py": "x = 1\n" * (MAX_FILE_LINES + 1),
        "fits.py": "class Fits:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1),
    })
    assert oversized(root) == [f"statepager/big.py: class Big of {MAX_CLASS_LINES + 1} lines",
                               f"statepager/long.py: {MAX_FILE_LINES + 1} lines"]


def test_the_check_finds_writes_through_self_outside_a_class(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "patch.py": "def step(self):\n    self._flag = True\n",
    })
    assert check(root) == ([], ["statepager.patch:2: uses ._flag, which it does not define"])
