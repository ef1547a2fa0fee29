"""use_external_data_format: export writes ONNX external data; models with external data load; a missing or
truncated data file is named; files are written with the user's umask (issue 14 item 4, issue 15 item 6)."""
from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest

import qtorch_onnx as qo
from qtorch_onnx import CalibrationMethod, Config, ModelQuantizer, QuantizationConfig, QuantType
from qtorch_onnx.lift import load_model
from qtorch_onnx.runtime import session



def mlp() -> onnx.ModelProto:
    """x [N, 64] -> Gemm(256) -> Relu -> Gemm(10): weights of 16 KiB and 2.5 KiB (above ONNX's 1 KiB external
    data threshold once quantized)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), name)
             for name, shape in (("w1", (256, 64)), ("b1", (256,)), ("w2", (10, 256)), ("b2", (10,)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2", transB=1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def samples(n=4):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (1, 64)).astype(np.float32)} for _ in range(n)]


def _quantize(tmp_path, external: bool):
    cfg = Config(global_quant_config=QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        use_external_data_format=external))
    out = tmp_path / ("ext.onnx" if external else "plain.onnx")
    ModelQuantizer(cfg).quantize_model(mlp(), str(out), samples(), progress=False)
    return out


def test_export_writes_external_data_that_loads_and_runs(tmp_path):
    plain = _quantize(tmp_path, False)
    ext = _quantize(tmp_path, True)
    assert not (tmp_path / "plain.onnx.data").exists()
    data = tmp_path / "ext.onnx.data"
    assert data.is_file() and data.stat().st_size > 0
    assert ext.stat().st_size < plain.stat().st_size  # the weights went to the data file
    raw = onnx.load(str(ext), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in raw.graph.initializer)
    x = samples(1)[0]
    a = session(load_model(str(plain))).run(None, x)[0]
    b = session(load_model(str(ext))).run(None, x)[0]
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # a model with external data lifts and quantizes again (read through load_model)
    qm = qo.prepare(str(ext), "BF16")
    assert qm(__import__("torch").from_numpy(x["x"])).shape == (1, 10)


def test_missing_or_truncated_external_data_is_named(tmp_path):
    ext = _quantize(tmp_path, True)
    data = tmp_path / "ext.onnx.data"
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(qo.ModelError, match=r"tensor '.*' needs bytes .*ext.onnx.data.*truncated"):
        load_model(str(ext))
    data.unlink()
    with pytest.raises(qo.ModelError, match=r"tensor '.*' is stored in the external data file .*ext.onnx.data.* "
                                            r"does not exist"):
        load_model(str(ext))


def test_exported_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        for external in (False, True):
            out = _quantize(tmp_path, external)
            assert stat.S_IMODE(out.stat().st_mode) == 0o644
            if external:
                assert stat.S_IMODE((tmp_path / "ext.onnx.data").stat().st_mode) == 0o644
    finally:
        os.umask(old)
