import pytest


@pytest.fixture
def all_implemented(monkeypatch):
    """Flip every feature flag of resolve.IMPLEMENTED to True for one test (what a later version does)."""
    from qtorch_onnx.config import resolve

    for key in resolve.IMPLEMENTED:
        monkeypatch.setitem(resolve.IMPLEMENTED, key, True)
    return resolve.IMPLEMENTED
