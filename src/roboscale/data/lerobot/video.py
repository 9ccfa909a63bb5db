"""Video and PNG codecs through PyAV (which bundles FFmpeg with libsvtav1, libdav1d, libx264 and png).

Encoding: ``VideoStreamWriter`` keeps one mp4 open per camera and appends each episode's frames with
``pts = frames so far`` (time base 1/fps), so an episode starts exactly at ``frames_before / fps`` in the file.
LeRobot instead encodes every episode to its own mp4 and concatenates it into the shard, rewriting the whole shard
per episode (O(n²) bytes); appending to the open stream writes each frame once.

Decoding: containers stay open between calls in a ``DecoderPool`` (``roboscale.data.loading.decode``: bounded,
fork-safe, a replaced file is opened afresh), the items of one episode reading the same file; here FFmpeg picks
its own decoder threads (the reader is not a loader worker). ``decode_frames`` does what LeRobot's PyAV
backend does (seek to the keyframe at or before the first query, decode forward, keep the nearest frame per query,
check it is within ``tolerance_s``); ``decode_range`` decodes a contiguous span (a whole episode) in one pass.
Both return uint8 RGB, or with ``depth=True`` the 12-bit codes of a LeRobot 0.6 depth map (``gray12le`` HEVC) as
uint16 [N, H, W, 1], which ``roboscale.data.lerobot.depth`` turns into distances.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from roboscale.data.lerobot.depth import DEPTH_PIX_FMT
from roboscale.data.loading.decode import DecoderPool, frame_array
from roboscale.errors import DatasetError

log = logging.getLogger(__name__)

DEFAULT_CODEC = "libsvtav1"
FALLBACK_CODEC = "libx264"

# SVT-AV1 prints a banner per encoder to stderr unless told otherwise; keep errors only (a user's setting wins).
os.environ.setdefault("SVT_LOG", "1")

# x264 has no numeric presets; map SVT-AV1's "fastest" end to ultrafast.
_X264_PRESET = "ultrafast"

_PIX_FMT_BY_CHANNELS = {1: "gray", 3: "rgb24", 4: "rgba"}


def available_codec(codec: str) -> str:
    """``codec`` when this FFmpeg build has it, else libx264 (with a warning)."""
    if codec in av.codecs_available:
        return codec
    if FALLBACK_CODEC not in av.codecs_available:
        raise RuntimeError(f"neither video encoder {codec!r} nor {FALLBACK_CODEC!r} is available in PyAV's FFmpeg")
    log.warning("video encoder %s is not available; falling back to %s", codec, FALLBACK_CODEC)
    return FALLBACK_CODEC


def canonical_codec_name(codec: str) -> str:
    """The codec name LeRobot records in info.json ("av1", "h264"), not the encoder's."""
    return av.codec.Codec(codec, "w").canonical_name


def _encoder_options(codec: str, g: int, crf: int, preset: int, fast_decode: int) -> dict[str, str]:
    options = {"g": str(g), "crf": str(crf)}
    if codec == "libsvtav1":
        options["preset"] = str(preset)
        if fast_decode:
            options["svtav1-params"] = f"fast-decode={fast_decode}"
    elif codec in ("libx264", "libx265"):
        options["preset"] = _X264_PRESET
        if codec == "libx265":
            options["x265-params"] = "log-level=error"  # x265 prints a banner and a summary per file otherwise
    return options


@contextlib.contextmanager
def _caller_scheduling_kept() -> Iterator[None]:
    """Restore the calling thread's scheduling policy after a call into the encoder.

    SVT-AV1 switches the thread that drives it to SCHED_FIFO at priority 99 where it may (as root). Left so, that
    thread, and every thread it starts afterwards (OpenMP's, torch's), preempts everything else: a process that
    writes a dataset and then trains (the demo, the test fixtures) starved concurrent jobs and its own OpenMP
    workers (a 3 s training took 5 minutes beside another one)."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, param)


class VideoStreamWriter:
    """One open mp4 (one video stream) that frames are appended to, episode after episode."""

    def __init__(
        self,
        path: str | Path,
        fps: int,
        width: int,
        height: int,
        codec: str = DEFAULT_CODEC,
        pix_fmt: str = "yuv420p",
        g: int = 2,
        crf: int = 30,
        preset: int = 12,
        fast_decode: int = 0,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fps = int(fps)
        self.width, self.height = int(width), int(height)
        self.codec = available_codec(codec)
        self.frames_written = 0
        self.bytes_muxed = 0  # compressed bytes handed to the muxer (frames still inside the encoder excluded)
        self.packets_muxed = 0
        self._time_base = Fraction(1, self.fps)
        with _caller_scheduling_kept():
            self._container = av.open(str(self.path), "w", format="mp4", options={"movflags": "faststart"})
            self._stream = self._container.add_stream(
                self.codec, rate=self.fps, options=_encoder_options(self.codec, g, crf, preset, fast_decode)
            )
        self._stream.width, self._stream.height = self.width, self.height
        self._stream.pix_fmt = pix_fmt
        self._stream.time_base = self._time_base
        self._closed = False

    def _mux(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            self.bytes_muxed += packet.size
            self.packets_muxed += 1
            self._container.mux(packet)

    def write(self, frame: np.ndarray) -> None:
        """Append one uint8 HxWx3 RGB frame."""
        if frame.shape != (self.height, self.width, 3) or frame.dtype != np.uint8:
            raise ValueError(
                f"{self.path}: expected uint8 frame of shape {(self.height, self.width, 3)}, got {frame.dtype} "
                f"{frame.shape}"
            )
        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        video_frame.pts = self.frames_written
        video_frame.time_base = self._time_base
        with _caller_scheduling_kept():
            packets = self._stream.encode(video_frame)
        self._mux(packets)
        self.frames_written += 1

    def write_many(self, frames: np.ndarray) -> None:
        for frame in frames:
            self.write(frame)

    def estimated_bytes_per_frame(self) -> float | None:
        """Average compressed frame size so far; None until the encoder has emitted anything."""
        return self.bytes_muxed / self.packets_muxed if self.packets_muxed else None

    def close(self) -> None:
        """Flush the encoder and write the index (moved to the front: faststart)."""
        if self._closed:
            return
        self._closed = True
        try:
            with _caller_scheduling_kept():
                packets = self._stream.encode(None)
            self._mux(packets)
        finally:
            with _caller_scheduling_kept():
                self._container.close()


# --------------------------------------------------------------------------------------------------- PNG


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of a uint8 HxWxC (C in 1, 3, 4) image."""
    image = np.ascontiguousarray(image)
    fmt = _PIX_FMT_BY_CHANNELS[image.shape[2]]
    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt = image.shape[1], image.shape[0], fmt
    frame = av.VideoFrame.from_ndarray(image[:, :, 0] if fmt == "gray" else image, format=fmt)
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def decode_png(data: bytes, channels: int = 3, source: str | Path = "<png>") -> np.ndarray:
    """uint8 HxWxC from PNG bytes (any PNG colour type, converted to ``channels``)."""
    fmt = _PIX_FMT_BY_CHANNELS[channels]
    try:
        frames = av.CodecContext.create("png", "r").decode(av.Packet(data))
    except (av.FFmpegError, ValueError) as e:
        raise DatasetError(source, f"cannot decode PNG image: {e}") from None
    if not frames:
        raise DatasetError(source, "cannot decode PNG image: no frame")
    array = frame_array(frames[0], fmt)
    return array[:, :, None] if array.ndim == 2 else array


# --------------------------------------------------------------------------------------------------- decoding


_DECODERS = DecoderPool(max_open=16, threads_per_decoder=0)


def _frames_between(container: av.container.InputContainer, stream: av.VideoStream, start_s: float, stop_s: float
                    ) -> list[tuple[float, av.VideoFrame]]:
    """Decoded (time, frame) pairs from the keyframe at/before ``start_s`` until the first frame at/after ``stop_s``.

    With B-frames (HEVC/H.264 from other encoders) the demuxer seeks by decode time, which can land on a keyframe
    whose first *presented* frame is already past ``start_s``; then we seek again from further back (doubling the
    margin, finally from the file start) so the frames at ``start_s`` are not skipped.
    """
    margin = 0.0
    while True:
        seek_s = max(0.0, start_s - margin)
        decoded = _decode_from(container, stream, seek_s, stop_s)
        if not decoded or decoded[0][0] <= start_s + 1e-6 or seek_s == 0.0:
            return decoded
        margin = max(2 * margin, 1.0)


def _decode_from(container: av.container.InputContainer, stream: av.VideoStream, seek_s: float, stop_s: float
                 ) -> list[tuple[float, av.VideoFrame]]:
    time_base = stream.time_base
    container.seek(max(0, int(seek_s / time_base)), stream=stream, backward=True, any_frame=False)
    decoded: list[tuple[float, av.VideoFrame]] = []
    for frame in container.decode(stream):
        if frame.pts is None:
            continue
        t = float(frame.pts * time_base)
        decoded.append((t, frame))
        if t >= stop_s:
            break
    return decoded


def _pixels(frame: av.VideoFrame, depth: bool) -> np.ndarray:
    """uint8 HxWx3 RGB, or uint16 HxWx1 12-bit codes of a depth stream."""
    if depth:
        return frame_array(frame, DEPTH_PIX_FMT)[:, :, None]
    return frame_array(frame, "rgb24")


def decode_frames(path: str | Path, timestamps: list[float] | np.ndarray, tolerance_s: float, *,
                  depth: bool = False) -> np.ndarray:
    """uint8 [N,H,W,3] (``depth``: uint16 codes [N,H,W,1]): for each query time (seconds in the file) the nearest
    frame, which must be within ``tolerance_s``."""
    queries = np.asarray(timestamps, dtype=np.float64).reshape(-1)

    def work(container: av.container.InputContainer, stream: av.VideoStream) -> np.ndarray:
        if queries.size == 0:
            return np.zeros((0, stream.height, stream.width, 1 if depth else 3), dtype=np.uint16 if depth else np.uint8)
        decoded = _frames_between(container, stream, float(queries.min()), float(queries.max()))
        if not decoded:
            raise DatasetError(path, f"no frames decoded at or after {queries.min():.6f}s")
        times = np.array([t for t, _ in decoded])
        nearest = np.abs(times[None, :] - queries[:, None]).argmin(axis=1)
        gaps = np.abs(times[nearest] - queries)
        if (gaps > tolerance_s).any():
            bad = int(gaps.argmax())
            raise DatasetError(
                path,
                f"no frame within tolerance_s={tolerance_s} of timestamp {queries[bad]:.6f}s (nearest decoded frame "
                f"at {times[nearest[bad]]:.6f}s); the video is shorter than the data or timestamps are off",
            )
        pixels = {int(i): _pixels(decoded[i][1], depth) for i in np.unique(nearest)}
        return np.stack([pixels[int(i)] for i in nearest])

    return _DECODERS.run(path, work)


def decode_range(path: str | Path, from_ts: float, to_ts: float, *, depth: bool = False) -> np.ndarray:
    """uint8 [N,H,W,3] (``depth``: uint16 codes [N,H,W,1]): every frame with ``from_ts <= time < to_ts`` (half a
    frame of slack on both ends)."""

    def work(container: av.container.InputContainer, stream: av.VideoStream) -> np.ndarray:
        rate = stream.average_rate or stream.guessed_rate
        half = 0.5 / float(rate) if rate else 1e-4
        decoded = _frames_between(container, stream, from_ts, to_ts - half)
        frames = [_pixels(f, depth) for t, f in decoded if from_ts - half <= t < to_ts - half]
        if not frames:
            raise DatasetError(path, f"no frames decoded between {from_ts:.6f}s and {to_ts:.6f}s")
        return np.stack(frames)

    return _DECODERS.run(path, work)


def frame_times(path: str | Path, from_ts: float, to_ts: float) -> np.ndarray:
    """Presentation times (seconds, float64) of the frames ``decode_range`` would return: every frame is decoded
    (so corrupt data is found) but not converted to RGB. For checking spans against what the metadata claims."""

    def work(container: av.container.InputContainer, stream: av.VideoStream) -> np.ndarray:
        rate = stream.average_rate or stream.guessed_rate
        half = 0.5 / float(rate) if rate else 1e-4
        decoded = _frames_between(container, stream, from_ts, to_ts - half)
        return np.array([t for t, _ in decoded if from_ts - half <= t < to_ts - half], dtype=np.float64)

    return _DECODERS.run(path, work)
