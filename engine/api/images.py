"""Images in chat messages: where an `image_url` may come from, and its bytes.

A vision model sees the images of a request's `image_url` parts. The engine
reads two kinds of URL and nothing else:

  data:image/png;base64,...   the image itself, in the request (what OpenAI's
                              clients send for a local screenshot)
  file:///abs/path.png        a file on this machine, only under one of the
                              folders listed in `engine.images.local_dirs`
                              (empty, the default: no file is ever read)

An http(s) URL is refused with `unsupported_parameter`: the engine never
fetches from the network on a request's say-so, and the gateway sends such a
request on to Ollama (through LiteLLM, which fetches it). `classify` is the
pure decision; `read_image_bytes` and `check_image` do the I/O.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from mlxd.api_errors import UNSUPPORTED_PARAMETER

from ..model.errors import EngineError, bad_request


@dataclass(frozen=True)
class ImagePolicy:
    local_dirs: tuple[Path, ...] = ()  # resolved; empty: local files are off
    max_images: int = 8  # per request
    max_bytes: int = 20 * 2**20  # one image's encoded size
    max_pixels: int = 50_000_000  # one image's decoded size (a decompression bomb is refused)

    @classmethod
    def from_config(cls, images) -> ImagePolicy:  # images: mlxd.config.ImagesConfig
        return cls(tuple(Path(d).expanduser().resolve() for d in images.local_dirs), images.max_per_request,
                   images.max_bytes, images.max_pixels)


@dataclass(frozen=True)
class DataUrl:
    payload: str  # base64


@dataclass(frozen=True)
class LocalFile:
    path: str


@dataclass(frozen=True)
class RemoteUrl:
    url: str


@dataclass(frozen=True)
class Unreadable:
    why: str


def classify(url: str) -> DataUrl | LocalFile | RemoteUrl | Unreadable:
    """What kind of image URL this is (pure)."""
    if url[:5].lower() == "data:":  # schemes are case-insensitive
        head, comma, payload = url.partition(",")
        if not comma:
            return Unreadable("a data URL needs a comma before its data")
        if not head[5:].lower().startswith("image/"):
            return Unreadable(f"a data URL of type {head[5:].split(';')[0]!r} is not an image")
        if not head.lower().endswith(";base64"):
            return Unreadable("an image data URL must be base64-encoded (data:image/png;base64,...)")
        return DataUrl(payload)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        return RemoteUrl(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            return Unreadable("a file URL must name a file on this machine (file:///path)")
        return LocalFile(unquote(parsed.path))
    return Unreadable("an image URL must be a data URL (data:image/...;base64,...) or a file URL (file:///...)")


def allowed_path(path: str, local_dirs: tuple[Path, ...]) -> Path | None:
    """The file, resolved (links followed), when it lies under an allowed
    folder; else None. Resolving first means `..` and links cannot step out."""
    if not local_dirs or not os.path.isabs(path):
        return None
    real = Path(path).resolve()
    return real if any(real.is_relative_to(d) for d in local_dirs) else None


def read_image_bytes(url: str, policy: ImagePolicy, where: str) -> bytes:
    """The encoded image an `image_url` names; the 400 that refuses it
    otherwise. `where` names the part (messages[0].content[1])."""
    param = f"{where}.image_url.url"
    source = classify(url)
    if isinstance(source, Unreadable):
        raise bad_request(f"{param}: {source.why}", param=param)
    if isinstance(source, RemoteUrl):
        raise EngineError(400, f"{param}: the engine does not fetch images from the network; send the image as a "
                               "data URL (data:image/png;base64,...)", code=UNSUPPORTED_PARAMETER, param=param)
    if isinstance(source, DataUrl):
        if len(source.payload) > policy.max_bytes * 4 // 3 + 4:
            raise bad_request(f"{param}: the image is over {policy.max_bytes // 2**20} MiB", param=param)
        try:
            return base64.b64decode(source.payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{param}: the data URL's base64 is invalid", param=param) from None
    path = allowed_path(source.path, policy.local_dirs)
    if path is None:
        why = ("local image files are off (list the folders they may come from in engine.images.local_dirs)"
               if not policy.local_dirs else "the file is not under a folder in engine.images.local_dirs")
        raise bad_request(f"{param}: {why}", param=param)
    try:
        if path.stat().st_size > policy.max_bytes:
            raise bad_request(f"{param}: the image is over {policy.max_bytes // 2**20} MiB", param=param)
        return path.read_bytes()
    except OSError as exc:
        raise bad_request(f"{param}: cannot read the file ({exc.strerror or exc})", param=param) from None


def check_image(data: bytes, policy: ImagePolicy, where: str) -> tuple[int, int]:
    """(width, height) of an encoded image, from its header; the 400 for
    bytes that are not an image PIL reads, or one too large to decode."""
    from PIL import Image

    param = f"{where}.image_url.url"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                size = img.size
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for bad bytes; all are the input's fault
        raise bad_request(f"{param}: not an image this engine can read ({type(exc).__name__})", param=param) from None
    if size[0] * size[1] > policy.max_pixels:
        raise bad_request(f"{param}: the image has {size[0]}x{size[1]} pixels, over this engine's limit of "
                          f"{policy.max_pixels}", param=param)
    return size
