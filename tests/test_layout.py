"""The layout a reader relies on: imports go one way (kernels <- nanodllm's core <- methods <- engines
<- eval), no import cycle, method files readable alone, the reference model free of the fast path,
and the size and docstring budgets of the files a reader opens first."""

import ast
import importlib
import re
from pathlib import Path

import pytest

from nanodllm.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nanodllm", "kernels")
METHOD_FILES = sorted({Path(METHODS[name].__module__.replace(".", "/") + ".py") for name in METHODS if name != "dense"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules of PACKAGES a file imports, anywhere in it (inside functions too), resolved."""
    tree = ast.parse(path.read_text())
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in PACKAGES}
    return found


FILES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
GRAPH = {name: {imported for imported in imports(path) if imported in FILES and imported != name}
         for name, path in FILES.items()}


def test_no_import_cycle():
    """Depth-first over the package's import graph; a back edge is a cycle (named in the failure)."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for nxt in sorted(GRAPH[name]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("path", METHOD_FILES, ids=lambda p: p.stem)
def test_a_method_file_imports_no_other_method_nor_the_eval_side(path):
    method_modules = {module_name(ROOT / p) for p in METHOD_FILES}
    name = module_name(ROOT / path)
    forbidden = {m for m in GRAPH[name] if m in method_modules}
    forbidden |= {m for m in GRAPH[name] if m.split(".")[-1] in ("loader", "tokenizer", "tasks", "eval", "recall",
                                                                  "graphs", "fused")}
    assert not forbidden, f"{path} imports {sorted(forbidden)}"


def test_kernels_import_only_torch_triton_and_each_other():
    for name, path in FILES.items():
        if name.startswith("kernels"):
            assert not {m for m in imports(path) if m.startswith("nanodllm")}, name


@pytest.mark.parametrize("name", ["model", "mlp"])
def test_the_reference_model_knows_nothing_of_kernels_graphs_or_fusion(name):
    text = (ROOT / f"nanodllm/{name}.py").read_text()
    assert not GRAPH[f"nanodllm.{name}"] - {"nanodllm.config", "nanodllm.mlp"}
    assert not re.search(r"kernel|graph|stacked|stack_in_place|triton|pending", text.split('"""', 2)[2], re.IGNORECASE)


@pytest.mark.parametrize("path, limit", [("nanodllm/model.py", 250), ("nanodllm/methods/base.py", 150)]
                         + [(str(p), 350) for p in METHOD_FILES])
def test_line_budgets(path, limit):
    assert len((ROOT / path).read_text().splitlines()) <= limit


@pytest.mark.parametrize("path", METHOD_FILES, ids=lambda p: p.stem)
def test_method_docstrings_keep_the_template(path):
    """Idea, paper, hooks, when it equals dense, knobs: in at most 30 lines."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text()))
    assert doc and len(doc.splitlines()) <= 30, f"{path}: {len(doc.splitlines())} docstring lines"
    for part in ("Paper", "Hooks", "Equals", "Knobs"):
        assert part in doc, f"{path}'s docstring has no {part!r}"


OUTSIDE = "/".join(["..", "shared"])  # the folder beside the checkout, which a reader does not have


def test_code_cites_no_path_outside_the_repository_and_logs_no_runs():
    """Papers by URL, never a folder outside the repository; no GPU product names or run history in
    code and docstrings (the numbers live in docs/results)."""
    for path in [*FILES.values(), *(ROOT / "scripts").glob("*.py"), ROOT / "train_free_demo.py"]:
        text = path.read_text()
        assert OUTSIDE not in text, path
        assert not re.search(r"\bH100\b|\bH200\b|\bsession\b", text), path


def test_the_readme_quotes_the_generation_table():
    """Every time and memory the README's methods table gives for a real generation is a cell of the
    committed table it cites (docs/results/bench_e2e_paper.md)."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| method | paper | engine | a generation"):]
    column = [line.split("|")[4] for line in table[:table.index("\n\n")].splitlines()[2:]]
    quoted = [n for cell in column for n in re.findall(r"(\d+(?:\.\d+)?) (?:s|ms|GiB)\b", cell)]
    results = (ROOT / "docs" / "results" / "bench_e2e_paper.md").read_text().splitlines()
    cells = {c.strip() for line in results if line.startswith(("| masked", "| block")) for c in line.split("|")}
    assert len(quoted) >= 20 and len(column) == 10
    assert [n for n in quoted if n not in cells] == []


def test_the_mutation_list_fits_the_code(monkeypatch):
    """scripts/mutate.py's every snippet occurs once in its file and every test it names exists, so the
    mutation check never silently tests nothing after the code moves."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    mutate = importlib.import_module("mutate")
    assert len(mutate.MUTATIONS) > 60
    assert mutate.problems(mutate.MUTATIONS, ROOT) == []
