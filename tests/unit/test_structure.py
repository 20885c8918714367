"""The codebase's shape as its users and the next features rely on it: the config never imports the
model, megabam claims no top-level import name but its own, the model registers a builder for every
mixer the config names, and every docs/ reference in the repo resolves inside it."""

import re
import subprocess
import sys
from pathlib import Path

from megabam.config.schema import MIXER_NAMES
from megabam.model import MIXERS

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


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
