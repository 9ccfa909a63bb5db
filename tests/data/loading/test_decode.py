"""DecoderPool: frames equal a fresh decode, sequential reads keep the decoder positioned, bounded open files."""

from __future__ import annotations

import os
from pathlib import Path

import av
import numpy as np
import pytest

from roboscale.data.lerobot.video import decode_frames
from roboscale.data.loading.decode import DecoderPool, frame_array
from roboscale.data.loading.raw_source import RawSource
from roboscale.errors import DatasetError


def test_forward_reads_do_not_seek_and_match_a_fresh_decode(fixture_root):
    source = RawSource(fixture_root)
    path, start = source.video_location(1, "observation.images.corner")
    fps, n = source.fps, int(source.episode_lengths[1])
    times = start + np.arange(n) / fps
    pool = DecoderPool(max_open=2)
    parts = [pool.read(path, times[i:i + 4], 1e-4) for i in range(0, n, 4)]  # chunk after chunk
    assert pool.seeks == 1  # only the first read seeks
    np.testing.assert_array_equal(np.concatenate(parts), decode_frames(path, times, 1e-4))
    pool.read(path, times[:2], 1e-4)  # backwards: must seek again, and still be right
    assert pool.seeks == 2
    skip = pool.read(path, times[[5, 6, 15]], 1e-4)  # a long gap ahead: seek rather than decode through
    np.testing.assert_array_equal(skip, decode_frames(path, times[[5, 6, 15]], 1e-4))


def test_errors_name_file_episode_and_field_and_open_files_are_bounded(fixture_root):
    source = RawSource(fixture_root)
    pool = DecoderPool(max_open=1)
    path, start = source.video_location(0, "observation.images.corner")
    with pytest.raises(DatasetError, match=r"file-000.mp4: episode 0: field 'observation.images.corner': no frame"):
        pool.read(path, [start + 0.5 / source.fps], 1e-4, field="observation.images.corner", episode=0)
    other, _ = source.video_location(0, "observation.images.gripper")
    pool.read(path, [start], 1e-4)
    pool.read(other, [start], 1e-4)
    assert pool.num_open == 1  # the LRU closed the first file
    pool.read(path, [start], 1e-4)
    assert pool.num_open == 1 and pool.opened == 4  # failed decoder dropped, reopened, evicted, reopened


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_converting_frames_to_rgb_starts_no_threads(fixture_root):
    """Loader workers are forked, and one forked while a swscale slice-thread pool existed hung freeing it (PyAV's
    default converts on one thread per core): frames are converted on the calling thread alone."""
    source = RawSource(fixture_root)
    path, start = source.video_location(1, "observation.images.corner")
    times = start + np.arange(8) / source.fps
    pool = DecoderPool(max_open=1, threads_per_decoder=1)
    before = _threads()
    pool.read(path, times, 1e-4)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        frame = next(container.decode(stream))
        rgb = frame_array(frame, "rgb24")
    assert rgb.shape[-1] == 3
    assert _threads() == before
