"""Images and videos of a dataset's rows, decoded and resized once (data.py), so that the engine and the trainer get
the same pixels. `cfg` below is data.DataConfig (its image, video and pixel fields).

- An image: a PIL image, {"bytes": ...} (or {"path": ...}, as `datasets` stores images), raw bytes or a path
  (relative ones joined with --data.image-dir), opened lazily (its size is known before its pixels are read) and
  scaled into [--data.min-pixels, --data.max-pixels] pixels, aspect ratio kept.
- Videos: their files are decoded with PyAV (FFmpeg's decoders and a container's own frame count and rate, in a wheel
  bound to no torch version, unlike torchcodec; decord is unmaintained and torchvision 0.28 has no reader),
  `--data.video-fps` frames a second are kept, uniformly, up to `--data.max-frames`, and each is resized like an image.
  A video's tokens are counted from its container's frame count, rate and size; at the same time each file is checked
  without being decoded in full (every packet read, the first frame decoded: probe_video), so that a file cut short is
  refused at start-up, not when its row is first drawn. A video's frames are one size: frames of two sizes are
  refused, not stretched to one.
"""

import io
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

# ---------------------------------------------------------------------------------------------------- images


def file_source(value, folder: str, flag: str, where: str, forms: str) -> tuple[Any, str]:
    """A file entry of an images or videos column -> (what to open: a path, or the bytes in a
    buffer; how the errors name it). {"bytes": b"..."} (or {"path": ...}, as `datasets` stores
    images), raw bytes, or a path (relative ones joined with `folder`, the value of `flag`);
    anything else is refused, naming the `forms` accepted."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        path = Path(folder) / value if folder else Path(value)
        return str(path), f"file {str(path)!r} ({flag} {folder!r})"
    if isinstance(value, bytes):
        return io.BytesIO(value), f"{len(value)} bytes"
    raise ValueError(f"{where}: {forms}, got {type(value).__name__}")


def open_image(value, image_dir: str, where: str, flag: str = "--data.image-dir") -> Image.Image:
    """One entry of an images column (or a video's frame) -> a PIL image (opened lazily: its size is
    known before its pixels are read): a PIL image, or a file (file_source). `where` names the
    dataset, row and image in the errors."""
    if isinstance(value, Image.Image):
        return value
    source, description = file_source(
        value, image_dir, flag, where,
        "an image must be a PIL image, {'bytes': ...}, bytes or a path")
    try:
        return Image.open(source)
    except (OSError, Image.UnidentifiedImageError) as error:
        raise ValueError(f"{where}: cannot read image {description}: {error}") from error


def resized_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size resize_image gives an image: (400, 300) with max_pixels 30,000 -> (200, 150)."""
    pixels = width * height
    if pixels > max_pixels or pixels < min_pixels:
        factor = math.sqrt((max_pixels if pixels > max_pixels else min_pixels) / pixels)
        return int(width * factor), int(height * factor)
    return width, height


def resize_image(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """Scale an image (aspect ratio kept) into [min_pixels, max_pixels] pixels, as RGB: the pixels
    the engine and the trainer both see (the processor then rounds the size to its patch grid)."""
    size = resized_size(image.width, image.height, min_pixels, max_pixels)
    image = image.resize(size) if size != image.size else image
    return image.convert("RGB")


# ---------------------------------------------------------------------------------------------------- videos


def frame_indices(total: int, fps: float, video_fps: float, max_frames: int) -> list[int]:
    """The frames kept of a `total`-frame video at `fps` frames a second: `video_fps` a second,
    spread uniformly from the first frame to the last, an even number (the models read frames in
    pairs) from 2 to `max_frames` (rounded down to even) and to `total` (rounded up: a one-frame
    video is its frame twice).

    >>> frame_indices(100, 25.0, 2.0, 32)  # 4 seconds: 8 frames
    [0, 14, 28, 42, 57, 71, 85, 99]
    >>> frame_indices(1, 25.0, 2.0, 32), frame_indices(4, 2.0, 2.0, 32)
    ([0, 0], [0, 1, 2, 3])
    """
    count = min(2 * max(1, round(total / fps * video_fps / 2)),
                max(2, max_frames - max_frames % 2), total + total % 2)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


REPLACE = "re-encode it (ffmpeg -i IN OUT), give its frames as a list of images, or drop the row"


def video_folder(cfg) -> tuple[str, str]:
    """(the folder relative video paths and frame paths are joined with, the flag that names it)."""
    return ((cfg.video_dir, "--data.video-dir") if cfg.video_dir
            else (cfg.image_dir, "--data.image-dir"))


def open_frame(value, cfg, where: str) -> Image.Image:
    """One frame of a list of frames: an image in any form of an images column, relative paths
    in video_folder."""
    folder, flag = video_folder(cfg)
    return open_image(value, folder, where, flag)


@contextmanager
def open_video(value, cfg, where: str):
    """A video file of a videos column (file_source) opened with PyAV: (container, its first video
    stream, how the errors name it), its errors naming the row and the file."""
    source, description = file_source(
        value, *video_folder(cfg), where,
        "a video must be a path, {'bytes': ...}, bytes or a list of frames")
    try:
        container = av.open(source)
    except (av.FFmpegError, OSError) as error:
        raise ValueError(f"{where}: cannot read video {description}: {error}") from error
    with container:
        if not container.streams.video:
            kinds = ", ".join(stream.type for stream in container.streams) or "none"
            raise ValueError(f"{where}: video {description} has no video stream (its streams: "
                             f"{kinds}): not a video, or the file is truncated or corrupt; "
                             f"{REPLACE}")
        try:
            yield container, container.streams.video[0], description
        except av.FFmpegError as error:
            raise ValueError(f"{where}: cannot decode video {description}: {error}; "
                             f"{REPLACE}") from error


def probe_video(value, cfg, where: str) -> tuple[int, float, tuple[int, int]]:
    """(frames, frames per second, (width, height)) of a videos-column entry, checked at start-up as
    far as it can be without decoding it all. A file: its packets read (not decoded) and counted,
    its first frame decoded; its frame count the container's (the packets' where the container does
    not say), its size its first frame's. A file whose whole packets fall short of that count (cut
    short) or whose first frame does not decode is refused here, not when its row is first drawn;
    decoding every frame kept would cost the start-up about as much as an epoch's reads
    (docs/speed-and-memory.md), so a packet that is whole but does not decode is found when its row
    is read, an error naming the row and the file (read_video). A list of frames: its length,
    --data.video-fps, and the size of the frames kept, one size for all (one_size)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where}: a list of frames with no frames")
        kept = sorted(set(frame_indices(len(value), cfg.video_fps, cfg.video_fps, cfg.max_frames)))
        sizes = {i: open_frame(value[i], cfg, f"{where}, frame {i}").size for i in kept}
        return len(value), cfg.video_fps, one_size(sizes, where)
    with open_video(value, cfg, where) as (container, stream, description):
        whole, first = 0, None  # packets read in full; the first frame
        # its last packet, empty, flushes the decoder's delayed frames
        for packet in container.demux(stream):
            whole += bool(packet.size) and not packet.is_corrupt
            if first is None:
                first = next(iter(packet.decode()), None)
        total = stream.frames or whole
        rate = stream.average_rate or stream.guessed_rate
    if total == 0:
        raise ValueError(f"{where}: video {description} has no frames (an empty file, or one cut "
                         f"short); {REPLACE}")
    if whole < total or first is None:
        raise ValueError(f"{where}: video {description} holds {whole} whole frames of the {total} "
                         f"its container lists" +
                         ("" if first is not None else ", none of which decodes") +
                         f": the file is truncated or corrupt; {REPLACE}")
    if not rate:
        raise ValueError(f"{where}: video {description} does not say its frame rate; give it as a "
                         "list of frames")
    return total, float(rate), (first.width, first.height)


def one_size(sizes: dict[int, tuple[int, int]], where: str) -> tuple[int, int]:
    """The one (width, height) of a video's frames ({frame index: size}); frames of two sizes are
    refused, naming both, rather than stretched to one (which would change one's aspect ratio)."""
    (first, size), *others = sizes.items()
    for index, other in others:
        if other != size:
            raise ValueError(f"{where}: frame {index} is {other[0]} x {other[1]} pixels, frame "
                             f"{first} {size[0]} x {size[1]}: a video's frames must be one size; "
                             "resize them alike (aspect ratio kept) or give them as two videos")
    return size


def read_video(value, cfg, where: str) -> tuple[np.ndarray, float, list[int], int]:
    """A videos-column entry as the engine and the trainer get it, the fields of a model.vision.Video (frames
    [T, H, W, 3] uint8, fps, indices, total): its frame_indices frames, each resized like an image (frames of two sizes
    are refused: one_size)."""
    total, fps, _ = probe_video(value, cfg, where)
    indices = frame_indices(total, fps, cfg.video_fps, cfg.max_frames)
    if isinstance(value, (list, tuple)):
        frames = {i: open_frame(value[i], cfg, f"{where}, frame {i}")
                  for i in sorted(set(indices))}
    else:
        frames, decoded = {}, 0
        with open_video(value, cfg, where) as (container, stream, description):
            # the frames are numbered from 0
            for decoded, frame in enumerate(container.decode(stream), 1):
                if decoded - 1 in indices:
                    frames[decoded - 1] = frame.to_image()
                if decoded > indices[-1]:
                    break
        if decoded <= indices[-1]:
            raise ValueError(f"{where}: video {description} decodes to {decoded} frames, not the "
                             f"{total} its container lists: the file is corrupt; {REPLACE}")
    width, height = resized_size(*one_size({i: frame.size for i, frame in frames.items()}, where),
                                 cfg.min_pixels, cfg.max_pixels)
    pixels = [frames[i] if frames[i].size == (width, height) else frames[i].resize((width, height))
              for i in indices]
    return (np.stack([np.asarray(frame.convert("RGB")) for frame in pixels]),  # [T, H, W, 3]
            fps, indices, total)
