"""Video decoding for loader workers: open containers in a bounded LRU, decoders kept positioned.

LeRobot's training path opens (or fetches from a cache) a decoder per sample and camera, seeks to the sample's
timestamp and decodes from the keyframe before it. Seeking flushes the decoder, so each sample pays a seek plus
up to a GOP of decodes. Measured on a 224² AV1 stream (g=2) on these machines: opening a container and decoding
its first frame ≈ 1.1–2.4 ms, a seek + decode ≈ 1.6–2 ms, the next frame of a running decoder ≈ 0.4–0.6 ms.

``DecoderPool.read(path, times)`` therefore keeps each container's decode iterator alive between calls: when the
first requested time lies a little ahead of where the decoder stands it decodes forward through the gap instead of
seeking (``max_skip_frames``: a seek costs about four sequential frames), and only seeks for backward jumps or
long gaps. Only matched frames are converted to RGB, by a converter kept per decoder (see ``_Decoder``).
Containers are bounded (``max_open``) so a worker's memory does not grow with the number of files (LeRobot's
unbounded decoder cache reached 30 GB per worker, #3614).

A pool belongs to one process; after ``fork`` the child starts an empty pool and leaves the parent's containers
alone (closing them would join decoder threads that do not exist in the child). Open files are keyed by their
identity (inode, size, mtime), so a file replaced since it was opened (repaired, re-encoded) is opened afresh.

The same pool serves one-off decodes that seek the container themselves (``run``): the LeRobot reader's and
``validate``'s (``roboscale.data.lerobot.video``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from roboscale.errors import DatasetError
from roboscale.utils.io import file_identity

#: swscale threads per pixel-format conversion. PyAV's default (0: one per core) leaves a slice-thread pool in the
#: converter, and a loader worker forked while one exists hung in ``avpriv_slicethread_free`` (a fresh-clone
#: ``make test``, FFmpeg 8.1): the pool's condition variable is copied mid-use and is never released in the child.
#: Loader workers already take every core, and converting a frame the size we train at costs microseconds.
SWSCALE_THREADS = 1


def frame_array(frame: av.VideoFrame, pix_fmt: str) -> np.ndarray:
    """``frame`` as an array in ``pix_fmt``, converted on the calling thread alone (see ``SWSCALE_THREADS``)."""
    return frame.to_ndarray(format=pix_fmt, threads=SWSCALE_THREADS)

_T = TypeVar("_T")


@dataclass
class _Decoder:
    path: Path
    container: av.container.InputContainer
    stream: av.VideoStream
    time_base: float
    frame_s: float
    frames: Iterator[av.VideoFrame] | None = None
    #: time (s) of the last frame taken from ``frames`` (None: not positioned)
    position: float | None = None
    last_rgb: np.ndarray | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    seeks: int = 0
    decoded: int = 0
    closed: bool = False
    identity: tuple[int, ...] = ()  # of the file when opened: a replaced file is opened afresh
    # One converter per decoder: ``frame.to_ndarray(format=...)`` builds a new swscale context for every frame,
    # which costs ~0.45 ms at 224², as much as decoding the frame; reused it costs ~0.05 ms.
    reformatter: VideoReformatter = field(default_factory=VideoReformatter)


class DecoderPool:
    """Open video decoders of one process, least recently used closed first."""

    def __init__(self, max_open: int = 8, threads_per_decoder: int = 1, max_skip_frames: int = 4):
        if max_open < 1:
            raise ValueError("max_open must be >= 1")
        self.max_open = max_open
        # Loader workers and camera threads already use every core; FFmpeg's default (one thread per core per
        # decoder) would oversubscribe them. 0 lets FFmpeg choose.
        self.threads_per_decoder = threads_per_decoder
        self.max_skip_frames = max_skip_frames
        self._open: OrderedDict[Path, _Decoder] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.seeks = 0
        self.decoded = 0
        self.opened = 0

    def __getstate__(self) -> dict:
        return {"max_open": self.max_open, "threads_per_decoder": self.threads_per_decoder,
                "max_skip_frames": self.max_skip_frames}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            _INHERITED.append(self._open)  # keep referenced, never closed (see module docstring)
            self._open, self._lock, self._pid = OrderedDict(), threading.Lock(), os.getpid()

    def _get(self, path: Path) -> _Decoder:
        self._check_fork()
        try:
            identity = file_identity(path)
        except OSError:
            identity = ()  # opening it reports the problem
        with self._lock:
            dec = self._open.get(path)
            if dec is not None and dec.identity == identity:
                self._open.move_to_end(path)
                return dec
        if dec is not None:  # the file was replaced (repaired, re-encoded) since it was opened
            self._drop(path)
        dec = _open(path, self.threads_per_decoder)
        dec.identity = identity
        with self._lock:
            self.opened += 1
            raced = self._open.get(path)
            if raced is not None:
                dec.container.close()
                return raced
            self._open[path] = dec
            while len(self._open) > self.max_open:
                _, old = self._open.popitem(last=False)
                with old.lock:  # never while another thread decodes with it
                    old.closed = True
                    old.container.close()
        return dec

    def _drop(self, path: Path) -> None:
        with self._lock:
            dec = self._open.pop(path, None)
        if dec is not None:
            dec.closed = True
            try:
                dec.container.close()
            except Exception:  # noqa: BLE001 - a broken container: nothing more to release
                pass

    def read(self, path: str | Path, times: np.ndarray, tolerance_s: float, *, field: str | None = None,
             episode: int | None = None) -> np.ndarray:
        """uint8 [N, H, W, 3]: the frame at each of the ascending ``times`` (seconds in the file), each within
        ``tolerance_s`` of its query (LeRobot's check)."""
        times = np.asarray(times, dtype=np.float64).reshape(-1)
        if times.size and np.any(np.diff(times) < 0):
            raise ValueError("DecoderPool.read needs ascending times")
        dec, out = self._with_decoder(Path(path), lambda d: _read(d, times, tolerance_s, self.max_skip_frames, field,
                                                                  episode), field, episode)
        self.seeks += dec.seeks
        self.decoded += dec.decoded
        dec.seeks = dec.decoded = 0
        return out

    def run(self, path: str | Path, work: Callable[[av.container.InputContainer, av.VideoStream], _T]) -> _T:
        """``work(container, stream)`` with the file's open container to itself, for a decode that seeks on its own
        (the decoder is unpositioned afterwards); decoding errors become a DatasetError naming the file."""

        def unpositioned(dec: _Decoder) -> _T:
            try:
                return work(dec.container, dec.stream)
            finally:
                dec.frames, dec.position, dec.last_rgb = None, None, None

        return self._with_decoder(Path(path), unpositioned, None, None)[1]

    def _with_decoder(self, path: Path, work: Callable[[_Decoder], _T], field: str | None, episode: int | None
                      ) -> tuple[_Decoder, _T]:
        try:
            while True:
                dec = self._get(path)
                with dec.lock:
                    if dec.closed:  # evicted by another thread between _get and the lock: open it again
                        continue
                    return dec, work(dec)
        except DatasetError:
            self._drop(path)
            raise
        except (av.FFmpegError, OSError, ValueError) as e:
            self._drop(path)
            raise DatasetError(path, f"cannot decode video (corrupt or truncated?): {e}", field=field,
                               episode=episode) from None

    def close(self) -> None:
        self._check_fork()
        with self._lock:
            items, self._open = list(self._open.values()), OrderedDict()
        for dec in items:
            dec.container.close()


_INHERITED: list[OrderedDict] = []


def open_video_stream(path: Path) -> tuple[av.container.InputContainer, av.VideoStream]:
    """Open a video file for decoding; a missing, corrupt or stream-less file becomes a DatasetError naming it."""
    if not path.is_file():
        raise DatasetError(path, "video file not found")
    try:
        container = av.open(str(path), "r")
    except (av.FFmpegError, OSError) as e:
        raise DatasetError(path, f"cannot open video (corrupt or truncated?): {e}") from None
    if not container.streams.video:
        container.close()
        raise DatasetError(path, "file has no video stream")
    return container, container.streams.video[0]


def _open(path: Path, threads: int) -> _Decoder:
    container, stream = open_video_stream(path)
    if threads:
        stream.codec_context.thread_count = threads
    rate = stream.average_rate or stream.guessed_rate
    frame_s = 1.0 / float(rate) if rate else 1.0 / 30
    return _Decoder(path, container, stream, float(stream.time_base), frame_s)


def _seek(dec: _Decoder, t: float) -> None:
    dec.container.seek(max(0, int(t / dec.time_base)), stream=dec.stream, backward=True, any_frame=False)
    dec.frames = dec.container.decode(dec.stream)
    dec.position = None
    dec.last_rgb = None
    dec.seeks += 1


def _read(dec: _Decoder, times: np.ndarray, tol: float, max_skip: int, field: str | None,
          episode: int | None) -> np.ndarray:
    h, w = dec.stream.codec_context.height, dec.stream.codec_context.width
    out = np.empty((times.size, h, w, 3), dtype=np.uint8)
    skip_s = (max_skip + 1) * dec.frame_s + tol  # up to max_skip frames decoded and dropped in between
    for j, query in enumerate(times):
        if j and abs(query - times[j - 1]) <= tol:  # the same frame twice (clamped windows)
            out[j] = out[j - 1]
            continue
        if dec.position is not None and abs(dec.position - query) <= tol and dec.last_rgb is not None:
            out[j] = dec.last_rgb
            continue
        # Behind us, far ahead, or not positioned: seek (to the keyframe at/before the query). Close ahead: decode on.
        if dec.position is None or query < dec.position - tol or query - dec.position > skip_s:
            _seek(dec, query)
        reseeked = dec.position is None
        while True:
            frame = next(dec.frames, None)
            if frame is None:
                dec.frames, dec.position = None, None
                raise DatasetError(dec.path, f"no frame at {query:.6f}s: the video ends before it (shorter than the "
                                             "data, or timestamps are off)", field=field, episode=episode)
            if frame.pts is None:
                continue
            dec.decoded += 1
            t = frame.pts * dec.time_base
            dec.position = t
            dec.last_rgb = None
            if t < query - tol:
                continue
            if t > query + tol:
                if not reseeked:  # a frame we skipped past must exist before: find it from its keyframe
                    _seek(dec, query)
                    reseeked = True
                    continue
                raise DatasetError(dec.path, f"no frame within tolerance_s={tol} of timestamp {query:.6f}s (next "
                                             f"frame at {t:.6f}s)", field=field, episode=episode)
            dec.last_rgb = dec.reformatter.reformat(frame, format="rgb24", threads=SWSCALE_THREADS).to_ndarray()
            out[j] = dec.last_rgb
            break
    return out
