"""The repository's layout rules (docs/design.md, "Layout and import rules"), read from the
tree itself so that a change that breaks one fails here:

- no import cycle among the modules of ``kernel_fun``, ``benchmarks`` and ``research``
  (every import, those inside functions too);
- the package imports nothing of the repository outside it, and only ``kernel_fun._fla``
  imports fla;
- a kernel module imports torch, triton and ``kernel_fun._triton`` only, and registers
  nothing itself (``kda/kernels/__init__.py`` does, with each implementation's capabilities);
- ``tests/`` never imports ``research/``; nothing imports a private name of another module;
- each shipped kernel's docstring tells its story in at most 40 lines, with a "Measured" line
  pointing at the README's tables; no commit hash in the package; every file of the
  repository the package's text names exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGES = {"kernel_fun": SRC / "kernel_fun", "benchmarks": ROOT / "benchmarks", "research": ROOT / "research"}
SHIPPED_KERNELS = sorted((SRC / "kernel_fun" / "kda" / "kernels").glob("[bf]*.py")) + \
    [SRC / "kernel_fun" / "cconv" / "kernels.py"]


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC if path.is_relative_to(SRC) else ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name (their tests' folders aside)."""
    found = {}
    for root in PACKAGES.values():
        for path in root.rglob("*.py"):
            if "tests" not in path.relative_to(root).parts:
                found[module_name(path)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, the name taken from it or None, line) of every import in the file,
    relative imports resolved; ``from a import b`` counts as importing ``a.b`` where that is
    a module."""
    tree = ast.parse(path.read_text())
    here = module_name(path) if path.is_relative_to(SRC) or any(path.is_relative_to(r) for r in PACKAGES.values()) \
        else ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".")
                pkg = pkg[:len(pkg) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full, None, node.lineno) if full in known else (base, alias.name, node.lineno))
    return out


def test_no_import_cycles():
    known = modules()
    graph = {name: {m for m, _, _ in imports(path, known) if m in known and m != name} for name, path in known.items()}
    done, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not cycles, cycles


def test_the_package_imports_nothing_of_the_repository_and_fla_only_through_one_module():
    known = modules()
    bad = []
    for name, path in known.items():
        if not name.startswith("kernel_fun"):
            continue
        for mod, _, line in imports(path, known):
            top = mod.split(".")[0]
            if top in ("benchmarks", "research", "tests", "conftest", "tools"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
            if top == "fla" and name != "kernel_fun._fla":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports fla ({mod}): kernel_fun._fla is fla's one door")
    assert not bad, bad


def test_kernel_modules_import_torch_triton_and_the_helpers_only():
    known = modules()
    allowed = ("torch", "triton", "kernel_fun._triton", "__future__")
    cute = ("torch", "cutlass", "cuda.bindings")  # (a CuTe DSL kernel, ``*_sm90.py``: CuTe DSL, imported when built)
    bad = []
    for path in SHIPPED_KERNELS:
        for mod, _, line in imports(path, known):
            if not any(mod == a or mod.startswith(a + ".") for a in (cute if path.stem.endswith("_sm90") else allowed)):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
        if "add_impl(" in path.read_text():
            bad.append(f"{path.relative_to(ROOT)} registers itself (kda/kernels/__init__.py does)")
    assert not bad, bad


def test_tests_never_import_research_and_no_one_imports_a_private_name():
    known = modules()
    files = [p for p in (ROOT / "tests").glob("*.py")] + [ROOT / "conftest.py"]
    files += [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    bad = []
    for path in files:
        for mod, name, line in imports(path, known):
            where = f"{path.relative_to(ROOT)}:{line}"
            if path.parent == ROOT / "tests" and mod.split(".")[0] == "research":
                bad.append(f"{where} imports {mod} (a test of the package imports no research instrument)")
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{where} imports the private name {name} from {mod}")
    assert not bad, bad


def test_shipped_kernel_docstrings_tell_the_current_story():
    bad = []
    for path in SHIPPED_KERNELS:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        lines = doc.strip("\n").count("\n") + 1
        if lines > 40:
            bad.append(f"{path.name}: a docstring of {lines} lines (at most 40; the rounds go in docs/log/)")
        if not re.search(r"^Measured:.*README", doc, re.M):
            bad.append(f"{path.name}: no 'Measured:' line pointing at the README's tables")
    assert not bad, bad


# A commit as the repository's text cites one: 7 to 40 hex digits with a digit and a letter.
_HASH = re.compile(r"(?<![0-9A-Za-z_.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


def test_the_package_cites_no_commit():
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in (SRC / "kernel_fun").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in _HASH.finditer(line)]
    assert not found, found


# A file of the repository as the package's text names one.
_PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|research|tests|scripts|kda|cconv|bench|tools)/[\w./-]*\w)")


def test_every_file_the_package_names_exists():
    missing = []
    for path in (SRC / "kernel_fun").rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in _PATH.finditer(line):
                name = m.group(1)
                if not any((base / name).exists() for base in (ROOT, SRC / "kernel_fun")):
                    missing.append(f"{path.relative_to(ROOT)}:{i}: {name}")
    assert not missing, missing


def test_the_checks_can_fail(tmp_path):
    """Each pattern finds what it is for (so the tests above cannot pass for want of a match)."""
    assert _HASH.search("measured at 3c7ec7f, B6") and _HASH.search("(sass e6bb8af5c61f82a7)")
    assert not _HASH.search("BV=64 4.88 ms 1e-5 0x1000 deadbeef 12345678")
    assert _PATH.search("see docs/log/b6.md,").group(1) == "docs/log/b6.md"
    fake = tmp_path / "m.py"
    fake.write_text("from kernel_fun.kda.stages import _REGISTRY\nimport research.b7_tiers\n")
    names = [(m, n) for m, n, _ in imports(fake, modules())]
    assert ("kernel_fun.kda.stages", "_REGISTRY") in names and ("research.b7_tiers", None) in names
