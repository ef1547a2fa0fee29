"""The typed configuration (issue 15 item 2): one frozen object per concern, enums that stay enums, read-only
mappings, and the flat vocabulary as a front end (ResolvedConfig.from_flat / setting)."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from qtorch_onnx.config import get_default_config, resolve_config
from qtorch_onnx.config.internal import (
    FLAT_NAMES, CalibMethod, CalibrationSettings, ExportFormat, FloatSettings, GraphSettings, OptimAlgorithm,
    PlacementSettings, ResolvedConfig,
)
from qtorch_onnx.errors import ConfigError
from qtorch_onnx.formats import spec as F


def test_groups_and_enums(all_implemented):
    r = resolve_config(get_default_config("A16W8"))
    assert isinstance(r.calibration, CalibrationSettings) and isinstance(r.placement, PlacementSettings)
    assert isinstance(r.floats, FloatSettings) and isinstance(r.graph, GraphSettings)
    assert r.calibration.method is CalibMethod.MINMAX and r.calibration.method == "MinMax"
    assert r.graph.quant_format is ExportFormat.EXTENDED_QDQ and f"{r.graph.quant_format}" == "ExtendedQDQ"
    ft = resolve_config(get_default_config("A8W8_ADAQUANT")).fast_finetune
    assert ft.optim_algorithm is OptimAlgorithm.ADAQUANT and ft.optim_algorithm == "adaquant"


def test_frozen_everywhere():
    r = resolve_config(get_default_config("A8W8"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.placement.per_channel = True  # type: ignore[misc]
    with pytest.raises(TypeError, match="frozen"):
        r.tensor_precision["x"] = F.INT8  # type: ignore[index]
    with pytest.raises(TypeError, match="frozen"):
        r.block_axes.update({"BFPAttributes": 1})  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(r)) == r and copy.deepcopy(r) == r


def test_from_flat_and_setting_round_trip():
    r = resolve_config(get_default_config("XINT8"))
    flat = {name: r.setting(name) for name in FLAT_NAMES}
    again = ResolvedConfig.from_flat(activation=r.activation, weight=r.weight, **flat)
    assert again.calibration == r.calibration and again.placement == r.placement and again.graph == r.graph
    assert r.setting("calibrate_method") == "MinMSE" and r.setting("power_of_two") is True
    # strings from a saved file become enums again
    assert ResolvedConfig.from_flat(activation=F.INT8, weight=F.INT8,
                                    calibrate_method="Percentile").calibration.method is CalibMethod.PERCENTILE


def test_bad_names_and_values_are_config_errors():
    with pytest.raises(ConfigError, match="per_chanel.*per_channel"):
        ResolvedConfig.from_flat(activation=F.INT8, weight=F.INT8, per_chanel=True)
    with pytest.raises(ConfigError, match="calibrate_method.*'MinMax'"):
        CalibrationSettings(method="Minmax")
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve_config(get_default_config("A8W8")).setting("nope")
