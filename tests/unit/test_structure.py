"""The codebase's shape as its users and the next features rely on it: the packages stand on floors
and no import runs back up, the config never imports the model, megabam claims no top-level import
name but its own, the model registers a builder for every mixer the config names, and every docs/
reference in the repo resolves inside it."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from megabam.config.schema import MIXER_NAMES
from megabam.model import MIXERS

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


# From the bottom up: a module may import its own floor's modules and lower ones, never higher ones
# (the longest prefix names a module's floor). Training stands on the checkpoint formats and on eval's
# scoring library; the commands that read trained runs or convert them stand above training.
FLOORS = [
    [
        "megabam",
        "megabam.errors",
        "megabam.exit_codes",
        "megabam.log",
        "megabam.process",
        "megabam.progress",
        "megabam.remote_args",
        "megabam.staging",
    ],
    ["megabam.config"],
    ["megabam.kernels"],
    ["megabam.model"],
    ["megabam.parallel"],
    ["megabam.data"],
    ["megabam.plan"],
    ["megabam.checkpoint"],
    [
        "megabam.eval.figures",
        "megabam.eval.generate",
        "megabam.eval.niah",
        "megabam.eval.passkey",
        "megabam.eval.perplexity",
    ],
    ["megabam.train"],
    ["megabam.cli", "megabam.convert", "megabam.eval", "megabam.launch", "megabam.prebuild"],
]


def floor_of(module: str) -> int:
    matches = [
        (len(prefix), floor)
        for floor, prefixes in enumerate(FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} stands on no floor: add it to FLOORS"
    return max(matches)[1]


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by its dotted name (kernels/ installs as megabam.kernels)."""
    modules = {}
    for folder, package in ((REPO / "megabam", "megabam"), (REPO / "kernels", "megabam.kernels")):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(module: str, path: Path) -> set[str]:
    """The megabam modules `module` imports anywhere in its body (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".")[: -node.level + (path.name == "__init__.py")]
                base = ".".join([*package, base] if base else package)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "megabam" or name.startswith("megabam.")}


def test_no_import_runs_back_up_the_floors():
    modules = package_modules()
    upward = []
    for module, path in sorted(modules.items()):
        for name in sorted(imported(module, path)):
            if name in modules and floor_of(name) > floor_of(module):
                upward.append(f"{module} imports {name}")
    assert not upward, upward


def test_the_floors_rule_sees_an_upward_import():
    """The rule's own check: training importing the convert command, or the checkpoint formats the
    trainer, is the arrow it exists to catch."""
    assert floor_of("megabam.convert.hf_export") > floor_of("megabam.train.trainer")
    assert floor_of("megabam.train.trainer") > floor_of("megabam.checkpoint.store")
    assert floor_of("megabam.eval.cli") > floor_of("megabam.train.trainer") > floor_of("megabam.eval.passkey")
    source = REPO / "megabam" / "train" / "engine.py"
    assert "megabam.checkpoint.consolidated" in imported("megabam.train.engine", source)


def test_config_loads_without_importing_the_model(tmp_path):
    done = _python(
        "import sys, megabam.config as c;"
        "c.load_config(None, ['model.layer_pattern=[SMG]', 'model.n_layers=3', 'model.swa.window=64',"
        "                     'window.windows=[16, 64]']);"
        "print(sorted(m for m in sys.modules if m.startswith(('megabam.model', 'megabam.kernels', 'torch'))))",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_kernels_install_inside_megabam_only(tmp_path):
    """Outside the repo (its root would put the kernels/ folder on sys.path) `kernels` is not ours."""
    done = _python(
        "import importlib.util, megabam.kernels.dispatch as d;"
        "print(importlib.util.find_spec('kernels'), d.__name__, d.__file__)",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    spec, name, file = done.stdout.split()
    assert spec == "None" and name == "megabam.kernels.dispatch"
    assert Path(file) == REPO / "kernels" / "dispatch.py"


def test_every_mixer_the_config_names_has_a_builder():
    assert set(MIXERS) == set(MIXER_NAMES)


def test_every_docs_reference_resolves():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    missing = set()
    for name in tracked.split():
        if not name.endswith((".py", ".md", ".yaml", ".sh", ".toml")):
            continue
        for ref in re.findall(r"\bdocs/[\w.-]+\.md", (REPO / name).read_text(errors="replace")):
            if not (REPO / ref).is_file():
                missing.add(f"{name}: {ref}")
    assert not missing, sorted(missing)
