"""Import costs and the lazy public API (issue 11 item 8).

``import qtorch_onnx`` loads neither torch nor onnx2torch (nor torchvision); ``get_library_path()`` works
without torch; ``import qtorch_onnx.quantizer`` does not load onnx2torch until a model is lifted;
``qtorch-onnx --help`` does not load torch. Each check runs in a fresh interpreter (this test process has
torch loaded already). Every name of ``__all__`` resolves, ``dir()`` lists them, and a name whose module is
missing raises a clear AttributeError.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import qtorch_onnx as qo

HEAVY = ("torch", "onnx2torch", "torchvision")


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the repository root; returns stdout (fails on a non-zero exit)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _loaded(code: str) -> list[str]:
    out = _run(textwrap.dedent(code) + f"\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    return eval(out.strip().splitlines()[-1])  # noqa: S307  (our own repr of a list of str)


def test_import_loads_neither_torch_nor_onnx2torch():
    assert _loaded("import qtorch_onnx") == []


def test_get_library_path_without_torch():
    code = """
        import os, sys
        import qtorch_onnx
        path = qtorch_onnx.get_library_path()
        assert os.path.isfile(path), path
        assert 'torch' not in sys.modules and 'onnx2torch' not in sys.modules and 'onnx' not in sys.modules
        # one build module, whichever way it is imported afterwards
        from qtorch_onnx.export.ort_ops import build
        assert build is sys.modules['qtorch_onnx.export.ort_ops.build']
        from qtorch_onnx.export.ort_ops.build import LibraryBuildError, library_path
        assert library_path() == path
        from qtorch_onnx.export import export  # the package itself still imports (with torch) afterwards
    """
    assert _loaded(code) == ["torch"]  # torch only from the final export import


def test_quantizer_import_does_not_load_onnx2torch():
    assert _loaded("import qtorch_onnx.quantizer") == ["torch"]
    assert _loaded("import qtorch_onnx.quantizer, qtorch_onnx.lift, qtorch_onnx.lift.normalize") == ["torch"]


def test_lift_loads_onnx2torch_and_registers_every_converter():
    code = """
        import qtorch_onnx as qo
        from qtorch_onnx.lift import converters as c
        assert c.converter_for('LSTM', 14) is not None  # recurrent.py
        assert c.converter_for('Loop', 16) is not None  # control_flow.py
        assert c.converter_for('BFPQuantizeDequantize', 1, 'com.amd.quark') is not None  # interop/ops_quark.py
        assert callable(qo.lift)
    """
    assert _loaded(code) == ["onnx2torch", "torch", "torchvision"]


def test_cli_help_does_not_load_torch():
    code = """
        from qtorch_onnx.cli import main
        try:
            main(['--help'])
        except SystemExit as exc:
            assert exc.code == 0
    """
    assert _loaded(code) == []


def _missing_modules() -> set[str]:
    return {m for m in set(qo._LAZY.values()) if importlib.util.find_spec(f"qtorch_onnx.{m}") is None}


def test_every_public_name_resolves():
    missing = _missing_modules()
    for name in qo.__all__:
        if qo._LAZY.get(name) in missing:  # a module another change adds: a clear AttributeError meanwhile
            with pytest.raises(AttributeError, match=f"qtorch_onnx.{qo._LAZY[name]}"):
                getattr(qo, name)
            continue
        assert getattr(qo, name) is not None, name
    assert set(qo._LAZY) | {"__version__"} <= set(qo.__all__) | {"__version__"}
    assert set(qo.__all__) <= set(dir(qo))
    if missing:
        pytest.skip(f"modules not in this tree yet: {sorted(missing)}")
    _run("from qtorch_onnx import *\nimport qtorch_onnx\nassert all(n in globals() for n in qtorch_onnx.__all__)")


def test_public_functions_win_over_submodules_of_the_same_name():
    """``qtorch_onnx.lift`` / ``qtorch_onnx.export`` are the functions, also after their submodules were imported
    (the import system would otherwise bind the submodule on the package)."""
    code = """
        import qtorch_onnx.export, qtorch_onnx.lift.lifter
        import qtorch_onnx as qo
        from qtorch_onnx import export, lift
        import types
        assert export is qo.export and lift is qo.lift
        assert not isinstance(qo.export, types.ModuleType) and not isinstance(qo.lift, types.ModuleType)
        assert qo.formats.spec.INT8.bits == 8 and qo.placement.__name__ == 'qtorch_onnx.placement'
    """
    _run(code)


def test_missing_name_or_module_raises_a_clear_attribute_error(monkeypatch):
    monkeypatch.setitem(qo._LAZY, "ghost", "no_such_module")
    monkeypatch.setitem(qo._LAZY, "phantom", "errors")
    with pytest.raises(AttributeError, match=r"'ghost'.*qtorch_onnx\.no_such_module"):
        qo.ghost  # noqa: B018
    with pytest.raises(AttributeError, match=r"'phantom'.*qtorch_onnx\.errors does not define it"):
        qo.phantom  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        qo.nothing_here  # noqa: B018
    with pytest.raises(ImportError):
        from qtorch_onnx import nothing_here  # noqa: F401
