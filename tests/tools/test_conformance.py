"""The conformance runner and a representative subset of ONNX's backend node tests through the lifter.

The subset (``CASES``) takes one to four cases of every op the lifter supports (and one function-expanded
case of the ops with many), spread over the op families; each must lift and match its expected outputs
under the runner's comparison rules. The full run is ``python -m qtorch_onnx.tools.conformance``.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from qtorch_onnx.tools import conformance as cf

CASES = [
    'test_abs', 'test_acos_example', 'test_acosh_example', 'test_add', 'test_affine_grid_2d', 'test_and2d',
    'test_argmax_no_keepdims_example', 'test_argmax_no_keepdims_example_select_last_index',
    'test_argmin_no_keepdims_example', 'test_argmin_no_keepdims_example_select_last_index', 'test_asin_example',
    'test_asinh_example', 'test_atan_example', 'test_atanh_example', 'test_attention_4d',
    'test_attention_4d_softcap', 'test_attention_3d_softcap', 'test_attention_3d_diff_heads_sizes_scaled_expanded',
    'test_averagepool_2d_precomputed_pads', 'test_averagepool_2d_pads', 'test_batchnorm_example',
    'test_bitcast_float32_to_int32', 'test_bitcast_uint32_to_int32', 'test_bitwise_and_i32_2d',
    'test_bitwise_not_2d', 'test_bitwise_or_i32_2d', 'test_bitwise_xor_i32_2d', 'test_blackmanwindow',
    'test_castlike_FLOAT_to_FLOAT16', 'test_castlike_FLOAT8E4M3FN_to_FLOAT16', 'test_castlike_INT4_to_FLOAT',
    'test_castlike_FLOAT8E5M2FNUZ_to_FLOAT_expanded', 'test_ceil_example', 'test_center_crop_pad_crop',
    'test_clip_default_inbounds', 'test_col2im', 'test_concat_1d_axis_0', 'test_concat_3d_axis_0', 'test_constant',
    'test_constantofshape_float_ones', 'test_basic_conv_with_padding', 'test_convinteger_without_padding',
    'test_convtranspose', 'test_convtranspose_kernel_shape', 'test_cos_example', 'test_cosh_example',
    'test_cumprod_1d', 'test_cumprod_2d_axis_0', 'test_cumsum_1d', 'test_cumsum_2d_axis_0', 'test_dft_opset19',
    'test_dft', 'test_basic_deform_conv_with_padding', 'test_det_2d', 'test_div_example', 'test_div_uint8',
    'test_dropout_default', 'test_dynamicquantizelinear', 'test_elu_example', 'test_equal', 'test_erf',
    'test_exp_example', 'test_expand_dim_changed', 'test_eyelike_without_dtype', 'test_flatten_axis0',
    'test_flatten_default_axis', 'test_floor_example', 'test_gru_defaults', 'test_gather_0',
    'test_gather_elements_0', 'test_gathernd_example_int32', 'test_gelu_tanh_1', 'test_gemm_default_zero_bias',
    'test_gemm_default_matrix_bias', 'test_globalaveragepool', 'test_globalmaxpool', 'test_greater',
    'test_greater_equal', 'test_gridsample', 'test_gridsample_nearest_align_corners_1_additional_1',
    'test_group_normalization_example', 'test_hammingwindow', 'test_hannwindow', 'test_hardsigmoid_example',
    'test_hardswish', 'test_hardmax_example', 'test_identity', 'test_if', 'test_instancenorm_example', 'test_isinf',
    'test_isnan', 'test_lrn', 'test_lstm_defaults', 'test_layer_normalization_4d_axis0',
    'test_layer_normalization_2d_axis0', 'test_layer_normalization_2d_axis0_expanded_ver18',
    'test_leakyrelu_example', 'test_less', 'test_less_equal', 'test_log_example', 'test_logsoftmax_example_1',
    'test_loop11', 'test_l2normalization_axis_0', 'test_lppool_1d_default', 'test_matmul_2d', 'test_matmulinteger',
    'test_max_example', 'test_max_uint8', 'test_maxpool_2d_uint8', 'test_maxpool_2d_same_upper',
    'test_maxunpool_export_without_output_shape', 'test_mean_example', 'test_mvn', 'test_melweightmatrix',
    'test_min_example', 'test_min_uint8', 'test_mish', 'test_mul_example', 'test_mul_uint8', 'test_neg_example',
    'test_nllloss_NC', 'test_nllloss_NCd1', 'test_nllloss_NCd1_expanded', 'test_nonmaxsuppression_suppress_by_IOU',
    'test_nonmaxsuppression_identical_boxes', 'test_nonzero_example', 'test_not_2d', 'test_or2d',
    'test_prelu_example', 'test_constant_pad', 'test_pow_example', 'test_pow_types_int64_float32',
    'test_qlinearconv', 'test_qlinearmatmul_2D_uint8_float32', 'test_rms_normalization_4d_axis0',
    'test_rms_normalization_2d_axis0', 'test_rms_normalization_2d_axis0_expanded', 'test_simple_rnn_defaults',
    'test_reciprocal_example', 'test_reduce_l1_do_not_keepdims_example',
    'test_reduce_l1_default_axes_keepdims_example', 'test_reduce_l2_do_not_keepdims_example',
    'test_reduce_l2_default_axes_keepdims_example', 'test_reduce_max_do_not_keepdims_example',
    'test_reduce_max_default_axes_keepdims_random', 'test_reduce_mean_do_not_keepdims_example',
    'test_reduce_min_do_not_keepdims_example', 'test_reduce_min_default_axes_keepdims_random',
    'test_reduce_prod_do_not_keepdims_example', 'test_reduce_prod_default_axes_keepdims_example',
    'test_reduce_sum_do_not_keepdims_example', 'test_reduce_sum_negative_axes_keepdims_example',
    'test_reduce_sum_square_do_not_keepdims_example', 'test_reduce_sum_square_default_axes_keepdims_example',
    'test_relu', 'test_reshape_reordered_all_dims', 'test_reshape_negative_dim',
    'test_resize_upsample_scales_nearest', 'test_resize_upsample_scales_cubic_A_n0p5_exclude_outside',
    'test_resize_downsample_sizes_cubic_antialias', 'test_rotary_embedding', 'test_round', 'test_stft',
    'test_scan_sum', 'test_scatter_without_axis', 'test_scatter_elements_without_axis', 'test_scatternd',
    'test_selu_example', 'test_shape_example', 'test_shape_end_negative_1', 'test_shrink_hard',
    'test_sigmoid_example', 'test_sign', 'test_sin_example', 'test_sinh_example', 'test_size_example', 'test_slice',
    'test_softmax_example', 'test_sce_none', 'test_sce_mean_weight_log_prob', 'test_sce_mean_no_weight_ii_4d',
    'test_sce_mean_weight_ii_3d_log_prob_expanded', 'test_softplus_example', 'test_softsign_example',
    'test_split_equal_parts_1d_opset13', 'test_split_variable_parts_1d_opset18', 'test_sqrt_example', 'test_squeeze',
    'test_sub_example', 'test_sub_uint8', 'test_sum_example', 'test_swish', 'test_tan_example', 'test_tanh_example',
    'test_tensorscatter', 'test_tfidfvectorizer_tf_only_bigrams_skip0', 'test_thresholdedrelu_example', 'test_tile',
    'test_top_k', 'test_transpose_default', 'test_triu', 'test_tril', 'test_unsqueeze_axis_0',
    'test_upsample_nearest', 'test_where_example', 'test_xor2d',
    # newer opsets than ONNX Runtime 1.31 runs (its "cannot run" category), quantization types included
    'test_quantizelinear', 'test_quantizelinear_e4m3fn', 'test_quantizelinear_int16', 'test_quantizelinear_int4',
    'test_quantizelinear_float4e2m1', 'test_dequantizelinear', 'test_dequantizelinear_e4m3fn',
    'test_dequantizelinear_e5m2', 'test_dequantizelinear_uint4', 'test_dequantizelinear_int2',
    'test_einsum_transpose', 'test_einsum_batch_matmul', 'test_onehot_without_axis', 'test_cast_FLOAT_to_FLOAT16',
    'test_cast_FLOAT8E5M2_to_FLOAT', 'test_cast_FLOAT_to_INT2', 'test_castlike_FLOAT_to_BFLOAT16',
    'test_castlike_FLOAT4E2M1_to_FLOAT16', 'test_unique_sorted_without_axis', 'test_compress_0',
    'test_depthtospace_example', 'test_range_float_type_positive_delta', 'test_bitshift_right_uint8',
    'test_mod_mixed_sign_float64', 'test_top_k_uint64', 'test_reversesequence_time', 'test_spacetodepth',
    'test_attention_4d_diff_heads_mask4d_padded_kv',
    'test_dequantizelinear_blocked', 'test_quantizelinear_blocked_asymmetric', 'test_swiglu',
]


@pytest.fixture(scope="module")
def cases():
    root = cf.generate_cases()  # cached per onnx version; regenerated (seconds) when missing
    return {c.name: c for c in cf.list_cases(root)}


def test_subset_is_representative(cases):
    assert 150 <= len(CASES) <= 250 and len(set(CASES)) == len(CASES)
    missing = [n for n in CASES if n not in cases]
    assert not missing, f"cases not generated by this onnx version: {missing}"
    ops = {cases[n].op for n in CASES}
    assert len(ops) >= 140  # one family per op: math, nn, quantization, attention, resampling, signal, ...
    assert {"Attention", "Resize", "QuantizeLinear", "DequantizeLinear", "LayerNormalization", "GridSample",
            "Einsum", "ScatterElements", "CumSum", "OneHot", "Trilu", "RMSNormalization", "RotaryEmbedding",
            "Gelu", "QLinearMatMul", "DynamicQuantizeLinear", "LSTM", "If"} <= ops
    assert all(cases[n].category == "main" for n in CASES)  # default domain, tensors, not training


@pytest.mark.parametrize("name", CASES)
def test_node_case_lifts_and_matches(cases, name):
    c = cases[name]
    res = cf.run_case(c.path, "lift", c.op, c.expanded)
    assert res["status"] == "pass", f"{name} ({c.op}): {res['status']}: {res['detail']}"


# ----------------------------------------------------------------------------------------- comparison rules
def test_compare_float_tolerance_nan_and_inf():
    w = np.array([1.0, np.nan, np.inf, -np.inf, 0.0], np.float32)
    assert cf.compare(w, w.copy()) is None
    assert cf.compare(w, w * (1 + 5e-5)) is None  # within rtol 1e-4
    assert "outside" in cf.compare(w, w + np.float32(1e-3))
    assert "NaN" in cf.compare(w, np.array([1.0, 0.0, np.inf, -np.inf, 0.0], np.float32))
    assert "infinities" in cf.compare(w, np.array([1.0, np.nan, -np.inf, -np.inf, 0.0], np.float32))
    assert "dtype" in cf.compare(w, w.astype(np.float64))
    assert "shape" in cf.compare(w, w[:4])


def test_compare_is_bit_exact_for_integers_small_floats_and_exact_ops():
    assert "differ" in cf.compare(np.array([1, 2], np.int32), np.array([1, 3], np.int32))
    a = np.array([1.0, -0.0], np.float32)
    b = np.array([1.0, 0.0], np.float32)
    assert cf.compare(a, b) is None  # -0 == 0 within tolerance
    assert "bit-exact" in cf.compare(a, b, exact=True)
    import ml_dtypes

    f8 = np.array([0.5, -0.0], np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert "bit-exact" in cf.compare(f8, np.array([0.5, 0.0], np.float32).astype(ml_dtypes.float8_e4m3fn))
    assert cf.compare(np.array([1.0], np.float64), np.array([1.0 + 1e-9], np.float64)) is None  # float64 is a float
    assert cf.compare(np.array([1.0], np.float16), np.array([1.0009765625], np.float16)) is None  # fp16: 1 eps


def test_torch_numpy_round_trip_of_exotic_dtypes():
    import ml_dtypes

    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4, ml_dtypes.uint4,
               ml_dtypes.float4_e2m1fn, np.float64, np.uint16):
        a = np.array([[0.5, 1.0, -2.0], [3.0, 0.0, 1.5]]).astype(dt) if np.dtype(dt).kind != "u" else \
            np.array([[1, 2, 3], [4, 5, 6]]).astype(dt)
        back = cf.to_numpy(cf.to_torch(a), a)
        assert back.dtype == a.dtype and np.array_equal(back.view(np.uint8), a.view(np.uint8)), dt


# ----------------------------------------------------------------------------------------- runner isolation
def test_runner_isolates_crashes_and_hangs(cases, monkeypatch):
    picked = [cases[n] for n in ("test_abs", "test_relu", "test_neg")]
    monkeypatch.setenv(cf.FAULT_ENV, "crash:test_relu")
    res = cf.run_cases(picked, modes=("ort",), jobs=1, timeout=60, progress=False)
    assert res["test_relu"]["ort"]["status"] == "crash"
    assert res["test_abs"]["ort"]["status"] == "pass" and res["test_neg"]["ort"]["status"] == "pass"
    monkeypatch.setenv(cf.FAULT_ENV, "hang:test_abs")
    res = cf.run_cases(picked[:2], modes=("ort",), jobs=1, timeout=3, progress=False)
    assert res["test_abs"]["ort"]["status"] == "timeout"
    assert res["test_relu"]["ort"]["status"] == "pass"


def test_report_has_categories_per_op_rows_and_reasons(cases, tmp_path):
    picked = [cases[n] for n in ("test_abs", "test_resize_downsample_scales_linear_align_corners", "test_lstm_defaults")]
    results = {c.name: {m: cf.run_case(c.path, m, c.op, c.expanded) for m in ("ort", "lift")} for c in picked}
    for r in results.values():
        r["onnx2torch"] = {"status": "error", "detail": "not run", "seconds": 0.0}
    text = cf.render_markdown(picked, results, wall_s=1.0, command="python -m qtorch_onnx.tools.conformance -f x")
    for cat in cf.CATEGORIES:
        assert f"| {cat} |" in text
    assert "| Abs | 1 | 1 | 1 | 0 | 1 |" in text
    resize_row = next(line for line in text.splitlines() if line.startswith("| Resize |"))
    assert "fractional output length" in resize_row  # the reason of the failure is written
    out = tmp_path / "conformance.md"
    out.write_text("old\n\n## Real models: lift time and inference ratio\n\nkept\n")
    cf.write_atomic(out, cf.replace_section(out, text))
    new = out.read_text()
    assert new.startswith("# Lifter conformance") and new.rstrip().endswith("kept")


def test_cli_filter_writes_report(tmp_path):
    import subprocess

    out, js = tmp_path / "c.md", tmp_path / "c.json"
    proc = subprocess.run([sys.executable, "-m", "qtorch_onnx.tools.conformance", "--filter", "^test_(abs|softsign)$",
                           "--modes", "ort,lift", "--jobs", "1", "--out", str(out), "--json", str(js)],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(js.read_text())
    assert {c["name"] for c in data["cases"]} == {"test_abs", "test_softsign"}
    assert all(r["lift"]["status"] == "pass" for r in data["results"].values())
    assert "| Softsign |" in out.read_text()
