"""Only here because cffi builds its extension through setuptools' ``cffi_modules``; metadata is in pyproject."""
from pathlib import Path
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSchemas(build_py):
    """Ship schemas/*.json inside the package (w4pack/_schemas) for non-editable installs."""

    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "w4pack" / "_schemas"
        dest.mkdir(parents=True, exist_ok=True)
        for p in Path("schemas").glob("*.json"):
            shutil.copy(p, dest / p.name)


setup(cffi_modules=["native/build_cpu.py:ffibuilder"], cmdclass={"build_py": BuildPyWithSchemas})
