"""An earlier version of energyattn, importable beside the current one, for before/after rows.

`load(revision)` extracts the package at a git revision of this checkout (`git archive`) into
a temporary folder as `energyattn_<revision>` and imports it. The package's modules import
each other relatively, so the copy runs its own code (its demos and `parallel` import the
installed `energyattn`, which the benchmarks do not use). Needs a git checkout.
"""

import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent

#: The last commit before the solver engine: fixed_point's own loop and custom_vjp,
#: the AFEM saddle point's own safeguarded Newton and custom_jvp.
BEFORE_ENGINE = "87ff9c9"


def load(revision: str = BEFORE_ENGINE) -> ModuleType:
    name = f"energyattn_{revision}"
    if name in sys.modules:
        return sys.modules[name]
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, "energyattn"],
        check=True,
        capture_output=True,
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="energyattn-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "energyattn").rename(folder / name)
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)
