"""Only here because cffi builds its extension through setuptools' ``cffi_modules``; metadata is in pyproject.

Wheels (``make wheel``): the CPU extension is built against the stable ABI (``_w4p_cpu.abi3.so``), so one wheel per
platform serves every CPython >= 3.10 (``py_limited_api``); auditwheel then gives it its manylinux tag. The CUDA
library ``w4pack/_lib/libw4p_cuda.so`` goes inside when it was built (``make cuda`` first): it links the CUDA runtime
statically and needs only the NVIDIA driver at run time, so that wheel is the GPU wheel and installs without nvcc.
"""
from pathlib import Path
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

#: loaded by Python's site module at start: registers "w4pack" with transformers in every process (see
#: _w4pack_autoregister.py); it must sit at the top of site-packages, outside the package
PTH = "w4pack-autoregister.pth"


class BuildPy(build_py):
    """Ship schemas/*.json inside the package (w4pack/_schemas) and the autoregister .pth beside it."""

    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "w4pack" / "_schemas"
        dest.mkdir(parents=True, exist_ok=True)
        for p in Path("schemas").glob("*.json"):
            shutil.copy(p, dest / p.name)
        shutil.copy(PTH, Path(self.build_lib) / PTH)
        if self.editable_mode:
            self._pth_into_editable_wheel()

    def _pth_into_editable_wheel(self) -> None:
        """``pip install -e .`` (PEP 660) installs only the editable wheel's root, not build_lib: put the .pth there.

        setuptools' editable_wheel points the ``install`` command's ``install_lib`` at the unpacked editable wheel
        (where it also writes data files) and zips that folder into the wheel, so a file written there lands in
        site-packages next to setuptools' own ``__editable__`` .pth. That .pth sorts first, so its finder already
        serves ``_w4pack_autoregister`` (a py-module, from the checkout) when ours imports it.
        """
        root = Path(self.get_finalized_command("install").install_lib)
        shutil.copy(PTH, root / PTH)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        """Declared outputs include the .pth, so the wheel (bdist_wheel installs build_lib) carries it."""
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cffi_modules=["native/build_cpu.py:ffibuilder"], cmdclass={"build_py": BuildPy},
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
