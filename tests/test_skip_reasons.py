"""Every skip says what would enable the test: missing fixtures (also behind pytest's "got empty parameter set"),
missing packages, no GPU; and one line at the end of the run counts the tests the missing fixtures cost."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import FIXTURES_HINT, with_enabling_hint

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest
from conftest import fixture_cases, fixture_path

@pytest.mark.parametrize("case", fixture_cases("gptq"))
def test_each_case(case):
    pass

def test_one_fixture():
    fixture_path("gptq", "ag_b4_asym_g64")

def test_needs_a_package():
    pytest.importorskip("w4pack_no_such_module")
'''


def test_a_run_without_fixtures_says_how_to_get_them(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "W4PACK_FIXTURES": str(tmp_path / "absent"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "test_sample.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "3 skipped" in out, out
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 3, out
    empty = next(line for line in skips if "got empty parameter set" in line)
    assert "W4PACK_FIXTURES=/path/to/fixtures" in empty
    assert any(f"W4PACK_FIXTURES={tmp_path / 'absent'} is not a folder" in line for line in skips)
    assert any("could not import 'w4pack_no_such_module'" in line and "pip install -e '.[test]'" in line
               for line in skips)
    assert f"2 tests skipped because {FIXTURES_HINT}" in out


def test_hints() -> None:
    assert with_enabling_hint("could not import 'w4pack.native.cpu': x").endswith("make native (or python setup.py "
                                                                                  "build_ext --inplace)")
    assert with_enabling_hint("a CUDA device is present") == "a CUDA device is present"
