"""The layers import only downward; core/ stays pure Python."""

import subprocess
import sys

import pytest


@pytest.mark.integration
def test_core_imports_neither_torch_nor_ray():
    code = (
        "import sys, pkgutil, importlib, raypaged.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'raypaged.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in ('torch', 'ray', 'triton', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.integration
def test_text_imports_neither_the_frontend_serve_nor_the_engine():
    """raypaged.text serves the frontend, Serve and the offline LLM, so it sits below all three."""
    code = (
        "import sys, pkgutil, importlib, raypaged.text as t\n"
        "for m in pkgutil.walk_packages(t.__path__, 'raypaged.text.'):\n"
        "    importlib.import_module(m.name)\n"
        "up = ('raypaged.frontend', 'raypaged.serve', 'raypaged.engine', 'raypaged.llm')\n"
        "bad = [m for m in sys.modules if m.startswith(up)]\n"
        "bad += [m for m in ('torch', 'ray') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
