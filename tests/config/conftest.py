import pytest


@pytest.fixture(autouse=True)
def gated_block_formats(monkeypatch):
    """These tests exercise the feature gate with the block formats, layer-wise and automatic mixed precision
    and fast finetune as the examples of gated features; the pipeline itself runs them all now
    (tests/quant/test_block_quantizers.py, tests/quant/test_layerwise.py, tests/algorithms), so their flags are
    switched off here."""
    from qtorch_onnx.config import resolve

    monkeypatch.setitem(resolve.IMPLEMENTED, "block_formats", False)
    monkeypatch.setitem(resolve.IMPLEMENTED, "layerwise_mixprecision", False)
    monkeypatch.setitem(resolve.IMPLEMENTED, "fast_finetune", False)
    monkeypatch.setitem(resolve.IMPLEMENTED, "auto_mixprecision", False)


@pytest.fixture
def all_implemented(monkeypatch):
    """Flip every feature flag of resolve.IMPLEMENTED to True for one test (what a later version does)."""
    from qtorch_onnx.config import resolve

    for key in resolve.IMPLEMENTED:
        monkeypatch.setitem(resolve.IMPLEMENTED, key, True)
    return resolve.IMPLEMENTED
