"""The layout a reader relies on: imports go one way (kernels <- nanodllm's core <- methods <- loops
<- generate <- eval), no import cycle, a method's mechanism in the file named for it (building on at
most one other method), replay and metering out of the methods and loops, the fast model built once,
and the size and docstring budgets of the files a reader opens first."""

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from nanodllm.methods import METHODS, Method, StepContext

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("nanodllm", "kernels")  # kernels/ is the package nanodllm.kernels
METHOD_FILES = sorted({Path(METHODS[name].__module__.replace(".", "/") + ".py") for name in METHODS if name != "dense"})


def module_name(path: Path) -> str:
    """The dotted name a file is imported by (kernels/ installs as nanodllm.kernels: pyproject.toml)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = ("nanodllm", *parts) if parts[0] == "kernels" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules of nanodllm a file imports, anywhere in it (inside functions too), resolved."""
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
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            names = submodules if node.module is None else [base] + submodules  # from . import x: x alone
        else:
            continue
        found |= {name for name in names if name.split(".")[0] == "nanodllm"}
    return found


FILES = {module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
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


SEEDS = ("mage", "maskkv", "momo", "dyllm", "sparse_dllm")  # the papers' own methods (the others are baselines)


def parent(cls) -> type:
    """The registered method a method's class builds on (Method itself for none)."""
    return cls.__bases__[0]


def code_lines(path: Path) -> int:
    """Lines of a file that are neither blank, comments nor docstrings."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docstrings)


def test_methods_holds_one_file_per_method_and_the_shared_ones():
    files = {p.name for p in (ROOT / "nanodllm" / "methods").glob("*.py")}
    assert files == {"__init__.py", "base.py", "common.py"} | {f"{name}.py" for name in METHODS if name != "dense"}
    assert all(METHODS[name].__module__ == f"nanodllm.methods.{name}" for name in METHODS if name != "dense")


@pytest.mark.parametrize("name", sorted(set(METHODS) - {"dense"}))
def test_a_method_builds_on_at_most_one_other_which_builds_on_none(name):
    """One base class: Method, or a registered method whose base is Method (one level, no chains); a
    method building on another says so in its class docstring."""
    cls = METHODS[name]
    assert len(cls.__bases__) == 1
    base = parent(cls)
    if base is not Method:
        assert base in METHODS.values() and parent(base) is Method, f"{name}: {cls.__mro__}"
        assert (cls.__doc__ or "").startswith("Builds on"), f"{name}'s class docstring says what it builds on"


@pytest.mark.parametrize("path", METHOD_FILES, ids=lambda p: p.stem)
def test_a_method_file_imports_no_other_method_than_its_base_nor_the_eval_side(path):
    method_modules = {module_name(ROOT / p) for p in METHOD_FILES}
    name = module_name(ROOT / path)
    base = parent(METHODS[path.stem])
    allowed = {base.__module__, f"{base.__module__}.{base.__name__}"}
    forbidden = {m for m in GRAPH[name] if m in method_modules and m not in allowed}
    forbidden |= {m for m in GRAPH[name] if m.split(".")[-1] in ("loader", "tokenizer", "tasks", "eval", "recall",
                                                                  "graphs", "meter", "fused", "generation")}
    assert not forbidden, f"{path} imports {sorted(forbidden)}"


@pytest.mark.parametrize("path", METHOD_FILES, ids=lambda p: p.stem)
def test_a_method_file_says_nothing_of_graphs_streams_or_statistics(path):
    """Recording, replay, side streams and counting what was read are the loops' business
    (nanodllm/graphs.py, meter.py), under the contract methods/base.py states."""
    text = (ROOT / path).read_text()
    found = re.findall(r"torch\.cuda|record_stream|side.stream|cuda stream|\bgraph|recording|replay|\bstats\b|end_step",
                       text, re.IGNORECASE)
    assert not found, f"{path} mentions {sorted(set(found))}"


@pytest.mark.parametrize("name", SEEDS)
def test_a_seed_method_reads_in_its_own_file_within_700_lines(name):
    """Its file holds its mechanism (at least 60 lines of code), and its file, the one it builds on,
    base.py and common.py together are at most 700 lines."""
    cls = METHODS[name]
    files = {ROOT / "nanodllm/methods/base.py", ROOT / "nanodllm/methods/common.py",
             ROOT / (cls.__module__.replace(".", "/") + ".py")}
    if parent(cls) is not Method:
        files.add(ROOT / (parent(cls).__module__.replace(".", "/") + ".py"))
    assert code_lines(ROOT / (cls.__module__.replace(".", "/") + ".py")) >= 60
    assert sum(len(p.read_text().splitlines()) for p in files) <= 700, sorted(p.name for p in files)


def test_the_step_context_is_built_per_step_and_never_changed():
    assert dataclasses.is_dataclass(StepContext) and StepContext.__dataclass_params__.frozen
    names = {field.name for field in dataclasses.fields(StepContext)}
    assert {"prompt_width", "t", "aside"} <= names


@pytest.mark.parametrize("loop", ["block", "masked", "dream", "fast_dllm_v2"])
def test_the_loops_call_the_hooks_and_choose_no_other_loop(loop):
    """One entry (nanodllm/generation.py) picks a family's loop and wraps the method for replay; the
    loops import neither another loop nor the replay machinery."""
    others = {f"nanodllm.{name}" for name in ("block", "masked", "dream", "fast_dllm_v2") if name != loop}
    imported = GRAPH[f"nanodllm.{loop}"]
    assert not imported & (others | {"nanodllm.graphs", "nanodllm.meter", "nanodllm.generation"}), imported
    assert "steps." not in (ROOT / f"nanodllm/{loop}.py").read_text()


def test_the_fast_model_is_built_once():
    """fused.py constructs its modules as such: no class swapping, no adjacency checks of weights per
    forward, no re-stacking on .to(); the first-use warm-up starts where a model is loaded."""
    text = (ROOT / "nanodllm/fused.py").read_text()
    assert len(text.splitlines()) <= 300
    for pattern in (r"__class__\s*=", r"data_ptr", r"def _apply", r"first_use\.start"):
        assert not re.search(pattern, text), pattern


def test_the_kernels_are_imported_as_installed():
    """kernels/ installs as nanodllm.kernels (pyproject.toml); `import kernels` would work only from a
    checkout, and there load a second copy of each kernel beside nanodllm's."""
    for path in [*FILES.values(), *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").glob("*.py"),
                 ROOT / "train_free_demo.py"]:
        tree = ast.parse(path.read_text())
        top = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        assert not {name for name in top if name.split(".")[0] == "kernels"}, path


def test_kernels_import_only_torch_triton_and_each_other():
    for name, path in FILES.items():
        if name.startswith("nanodllm.kernels"):
            assert not {m for m in imports(path) if not m.startswith("nanodllm.kernels")}, name


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
    """Idea, paper, hooks, when it equals dense, knobs: in at most 25 lines."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text()))
    assert doc and len(doc.splitlines()) <= 25, f"{path}: {len(doc.splitlines())} docstring lines"
    for part in ("Paper", "Hooks", "Equals", "Knobs"):
        assert part in doc, f"{path}'s docstring has no {part!r}"


@pytest.mark.parametrize("name", sorted(set(FILES) - {module_name(ROOT / p) for p in METHOD_FILES}))
def test_module_docstrings_fit_a_screen(name):
    doc = ast.get_docstring(ast.parse(FILES[name].read_text())) or ""
    assert len(doc.splitlines()) <= 15, f"{name}: {len(doc.splitlines())} docstring lines"


def test_the_readme_fits_150_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_no_line_of_code_is_wider_than_120():
    for path in [*FILES.values(), *ROOT.glob("scripts/*.py"), *ROOT.glob("tests/*.py"), ROOT / "train_free_demo.py"]:
        wide = [number for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
        assert wide == [], f"{path.relative_to(ROOT)}: lines {wide} are over 120 characters"


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
    """tests/plants.py's every snippet occurs once in its file and every test it names exists, so
    tests/mutate.py never silently tests nothing after the code moves."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    mutate = importlib.import_module("mutate")
    assert len(mutate.MUTATIONS) > 60
    assert mutate.problems(mutate.MUTATIONS, ROOT) == []
