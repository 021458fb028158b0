"""Layering rules of the code base, checked by parsing (never importing) the sources with `ast`: fast, CPU only.

The layers, bottom up: models/ (pure nn.Modules) and float8/ (a conversion applied to any module), then parallelize/
(plans applied to a model), then titanlike/ (the trainer and its services), then scripts/ (entry points). An import
may only point down. Every import counts: module level, inside functions, `from x import y` where y is a submodule,
relative imports, and importlib.import_module("literal"). Only rule 2 and the cycle rules ignore imports under
`if TYPE_CHECKING:`, which never run.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "parallelize", "float8", "titanlike")
SOURCE_DIRS = PACKAGES + ("scripts",)


FILES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p  # module name -> file
         for top in SOURCE_DIRS for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts}
# A script runs with its own folder on sys.path, so `import bench_matrix` means scripts/bench/bench_matrix.py.
SCRIPT_STEMS = {m.rsplit(".", 1)[-1]: m for m in sorted(FILES, reverse=True) if m.startswith("scripts.")}


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the repository root
    line: int
    importer: str  # module name of the importing file
    name: str  # absolute dotted name imported: "torch.distributed.tensor", "titanlike.config.validate.CHOICES"
    target: str | None  # the project module it loads (None: stdlib or third party)
    type_only: bool  # under `if TYPE_CHECKING:`

    @property
    def layer(self) -> str | None:  # the top-level folder imported from, also for a module that does not exist (yet)
        top = (self.target or self.name).split(".")[0]
        return top if top in SOURCE_DIRS else None

    def __str__(self):
        where = f" (= {self.target})" if self.target and self.layer != self.name.split(".")[0] else ""
        return f"{self.file}:{self.line}: imports {self.name}{where}" + (" [TYPE_CHECKING]" if self.type_only else "")


def _resolve(name: str, importer: str) -> str | None:
    """The project module `name` loads: its longest prefix that is a module (`from a.b import c` loads a.b.c when c is
    a submodule, else a.b's __init__), or a script beside the importer / anywhere in scripts/ for bare script names."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FILES:
            return ".".join(parts[:n])
    sibling = importer.rpartition(".")[0] + "." + parts[0]
    return sibling if sibling in FILES else SCRIPT_STEMS.get(parts[0])


def _nodes(node: ast.AST, type_only: bool = False):
    """Every node below `node`, with whether it sits in the body of an `if TYPE_CHECKING:` (its else branch runs)."""
    for child in ast.iter_child_nodes(node):
        branches = [([child], type_only)]
        if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
            branches = [(child.body, True), (child.orelse, type_only)]
        for stmts, flag in branches:
            for stmt in stmts:
                yield stmt, flag
                yield from _nodes(stmt, flag)


@lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    return ast.parse(FILES[module].read_text(encoding="utf-8"), filename=str(FILES[module]))


def _names_imported(node: ast.AST, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: start from the importer's package, one level up per extra dot
            pkg = module.split(".") if FILES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(pkg[:max(0, len(pkg) - node.level + 1)] + ([node.module] if node.module else []))
        return [base if a.name == "*" else f"{base}.{a.name}" for a in node.names]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str) and _dotted(node.func, {}) in
            ("importlib.import_module", "import_module", "__import__")):
        return [node.args[0].value]
    return []


@lru_cache(maxsize=None)
def imports() -> tuple[Import, ...]:
    out = []
    for module, path in FILES.items():
        for node, type_only in _nodes(_tree(module)):
            for name in _names_imported(node, module):
                out.append(Import(str(path.relative_to(ROOT)), node.lineno, module, name, _resolve(name, module),
                                  type_only))
    return tuple(out)


def _forbidden(folder: str, banned: tuple[str, ...], *, allow_type_only: bool = False) -> list[Import]:
    """Imports in files under `folder` that load anything from the folders `banned`."""
    return [i for i in imports() if i.file.split("/")[0] == folder and i.layer in banned
            and not (allow_type_only and i.type_only)]


def _check(offenders: list, rule: str, fix: str) -> None:
    if offenders:  # the rule, every offender, and the fix: no traceback needed
        lines = "\n".join(f"  {o}" for o in offenders)
        pytest.fail(f"{rule}\n{len(offenders)} violation(s):\n{lines}\nHow to fix: {fix}", pytrace=False)


def test_models_import_no_distributed_trainer_or_plans():
    # models/ are plain nn.Modules: importable and testable without a process group, and reusable outside the trainer.
    bad = [i for i in imports() if i.file.startswith("models/")
           and (i.name == "torch.distributed" or i.name.startswith("torch.distributed."))]
    bad += _forbidden("models", ("titanlike", "parallelize", "float8", "scripts"))
    _check(bad, "Rule 1: models/ imports neither torch.distributed nor titanlike, parallelize, float8 or scripts.",
           "keep sharding/collectives in parallelize/ or titanlike/distributed/; pass what a model needs in as "
           "arguments (ModelArgs, flavors in models/<name>/) instead of importing it from the layers above.")


def test_parallelize_does_not_know_the_trainer():
    # Plans are applied to a model; they must not depend on the trainer, its config or the CLIs, so any caller can use
    # them. Type hints of trainer types go under `if TYPE_CHECKING:`.
    _check(_forbidden("parallelize", ("titanlike", "scripts"), allow_type_only=True),
           "Rule 2: parallelize/ imports nothing from titanlike/ or scripts/ (models, float8, torch are fine).",
           "take the values a plan needs as arguments (mesh, sizes, option strings) or move the shared definition "
           "(e.g. a constant or ParallelDims) down into parallelize/ and have titanlike import it from there.")


def test_float8_is_a_leaf():
    # float8/ converts any nn.Module; knowing a model, a plan or the trainer would tie it to one of them.
    _check(_forbidden("float8", ("titanlike", "parallelize", "models", "scripts")),
           "Rule 3: float8/ imports nothing from titanlike/, parallelize/, models/ or scripts/.",
           "pass module filters/FQNs and settings in as arguments; let the caller (titanlike) wire float8 to a "
           "model.")


def test_library_does_not_import_scripts():
    # scripts/ are entry points on top of the library; the library must work without them (they are not installed).
    _check(_forbidden("titanlike", ("scripts",)), "Rule 4: titanlike/ imports nothing from scripts/.",
           "move the shared code from the script into titanlike/ and have the script import it from there.")


def _graph(node_of, same_group=lambda a, b: True) -> dict[str, dict[str, list[Import]]]:
    """Import edges between the nodes `node_of` maps modules to (None: left out), type-only imports excluded."""
    g: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for i in imports():
        if i.target and not i.type_only and same_group(i.importer, i.target):
            a, b = node_of(i.importer), node_of(i.target)
            if a and b and a != b:
                g[a][b].append(i)
    return g


def _cycles(g) -> list[str]:
    """For every edge a -> b on a cycle, the shortest cycle through it (each cycle once), with the import sites."""
    found = {}
    for a in sorted(g):
        for b in sorted(g[a]):
            paths, todo = {b: [a, b]}, deque([b])  # BFS for the shortest way back b -> ... -> a
            while todo and a not in paths:
                cur = todo.popleft()
                for nxt in sorted(g.get(cur, ())):
                    if nxt not in paths:
                        paths[nxt] = paths[cur] + [nxt]
                        todo.append(nxt)
            if a not in paths:
                continue
            cycle = paths[a][:-1]  # a, b, ..., the module before a
            k = cycle.index(min(cycle))
            found.setdefault(tuple(cycle[k:] + cycle[:k]), None)
    out = []
    for cycle in found:
        ring = list(cycle) + [cycle[0]]
        sites = []  # per edge, each import line once with the names it imports
        for x, y in zip(ring, ring[1:]):
            by_line = defaultdict(list)
            for i in g[x][y]:
                by_line[f"{i.file}:{i.line}"].append(i.name)
            sites.append(f"\n      {x} -> {y}: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in by_line.items()))
        out.append(" -> ".join(ring) + "".join(sites))
    return out


def _subpackage(module: str) -> str | None:
    parts = module.split(".")  # titanlike/data/tokenizers is part of data
    return ".".join(parts[:2]) if parts[0] == "titanlike" else None


def test_no_cycles_between_top_level_packages():
    # A package cycle means neither side can be used, tested or reasoned about without the other.
    g = _graph(lambda m: m.split(".")[0] if m.split(".")[0] in PACKAGES else None)
    _check(_cycles(g), "Rule 5a: the import graph between models, parallelize, float8 and titanlike must be a DAG.",
           "move the shared code down into the lower package (models/float8 -> parallelize -> titanlike).")


def test_no_cycles_between_titanlike_subpackages():
    # The trainer's services (config, data, checkpoint, ...) layer on each other; a cycle fuses them into one blob.
    _check(_cycles(_graph(_subpackage)),
           "Rule 5b: the import graph between titanlike's subpackages (config, distributed, train, optim, data, "
           "checkpoint, resilience, observe) must be a DAG.",
           "move the shared piece into the lower subpackage (config is the bottom), or pass it in as an argument.")


def test_no_module_cycles_inside_a_package():
    # Module cycles make import order matter and break partial imports; function-level imports only hide them.
    def group(m):
        return _subpackage(m) or m.split(".")[0]
    _check(_cycles(_graph(lambda m: m, lambda a, b: group(a) == group(b))),
           "Rule 5c: no import cycle between modules of one package (function-level imports count; a submodule "
           "importing names from its own package's __init__, which imports it, is a cycle).",
           "import from the defining submodule rather than the package __init__, or move the shared code into a "
           "module both can import.")


# Where "llama" names something other than the model family, with the reason.
LLAMA_ALLOWED = {
    # Tokenizer file formats named after the models that introduced them (Llama 3's tiktoken tokenizer.model,
    # Llama 2's sentencepiece .model): data formats, which any family may use.
    "titanlike/data/tokenizers/tiktoken_bpe.py", "titanlike/data/tokenizers/sentencepiece_model.py",
    # The peer's own model names (torchtitan's `--model.name llama3`): the benchmark's other side.
    "scripts/bench/peer_torchtitan.py", "scripts/bench/peer_torchtitan.sh",
}
# Megatron's --tokenizer-type values, which users pass as they are (data formats again, not models).
MEGATRON_TOKENIZER_NAMES = re.compile(r"llama[23]tokenizer", re.IGNORECASE)


def test_no_llama_outside_models_and_plans():
    # Model knowledge belongs in models/<name>/ and parallelize/<name>.py; the trainer and CLIs stay model-agnostic.
    bad = []
    for top in ("titanlike", "scripts"):
        for path in sorted((ROOT / top).rglob("*")):
            if str(path.relative_to(ROOT)) in LLAMA_ALLOWED:
                continue
            if path.is_file() and "__pycache__" not in path.parts and b"\0" not in (data := path.read_bytes()):
                for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if re.search("llama", MEGATRON_TOKENIZER_NAMES.sub("", line), re.IGNORECASE):
                        bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:110]}")
    _check(bad, "Rule 6: no file under titanlike/ or scripts/ mentions 'llama' (any case; code, comments, strings).",
           "move the model-specific code/defaults into models/<name>/ (its ModelSpec, flavors, HF mapping) or "
           "parallelize/<name>.py and reach them through the model registry; word comments and examples generically.")


def _dotted(expr: ast.expr, aliases: dict[str, str]) -> str:
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id, expr.id)
    if isinstance(expr, ast.Attribute):
        return f"{_dotted(expr.value, aliases)}.{expr.attr}"
    return ""


PATH_CALLS = ("sys.path.insert", "sys.path.append", "sys.path.extend", "site.addsitedir")


def test_no_sys_path_changes():
    # Imports must resolve the same way for tests, torchrun and an installed package: `pip install -e .` instead.
    bad = []
    for module, path in FILES.items():
        tree, aliases = _tree(module), {}
        for node in ast.walk(tree):  # `import sys as s`, `from sys import path`: track the names sys.path goes by
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "site"):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        for node in ast.walk(tree):
            targets = getattr(node, "targets", [getattr(node, "target", None)])  # x = / x += / x[:0] =
            if (isinstance(node, ast.Call) and _dotted(node.func, aliases) in PATH_CALLS) or (
                    isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                    _dotted(getattr(t, "value", t) if isinstance(t, ast.Subscript) else t, aliases) == "sys.path"
                    for t in targets)):
                bad.append((str(path.relative_to(ROOT)), node.lineno, ast.get_source_segment(path.read_text(), node)))
    bad = [f"{f}:{n}: {code}" for f, n, code in sorted(bad)]
    _check(bad, "Rule 7: no file under titanlike/, models/, parallelize/, float8/ or scripts/ adds to sys.path.",
           "rely on the installed package (pip install -e .) and absolute imports; a script's own folder is already "
           "on sys.path when it runs.")
