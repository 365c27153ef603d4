"""The layers import only downward; core/ stays pure Python."""

import subprocess
import sys


def test_core_imports_neither_torch_nor_ray():
    code = (
        "import sys, pkgutil, importlib, raypaged.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'raypaged.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in ('torch', 'ray', 'triton', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
