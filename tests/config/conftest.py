import pytest


@pytest.fixture(autouse=True)
def gated_block_formats(monkeypatch):
    """These tests exercise the feature gate with the block formats as the example of a gated feature; the
    pipeline itself runs them now (tests/quant/test_block_quantizers.py), so the flag is switched off here."""
    from qtorch_onnx.config import resolve

    monkeypatch.setitem(resolve.IMPLEMENTED, "block_formats", False)


@pytest.fixture
def all_implemented(monkeypatch):
    """Flip every feature flag of resolve.IMPLEMENTED to True for one test (what a later version does)."""
    from qtorch_onnx.config import resolve

    for key in resolve.IMPLEMENTED:
        monkeypatch.setitem(resolve.IMPLEMENTED, key, True)
    return resolve.IMPLEMENTED
