"""``episodes.jsonl``: one line per finished episode, appended as it finishes, so an interrupted evaluation
resumes where it stopped. Each line is one ``write`` of the whole line followed by ``fsync``; a line a kill cut
short is the last one and is ignored (and overwritten) on reading."""

from __future__ import annotations

import json
import os
from pathlib import Path

from roboscale.rollout.episode import EpisodeResult

EPISODES_FILE = "episodes.jsonl"


class EpisodeLog:
    def __init__(self, directory: Path):
        self.path = Path(directory) / EPISODES_FILE

    def read(self) -> list[EpisodeResult]:
        """The complete lines; a torn last line is cut off the file so that appends start on a fresh line."""
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        return [EpisodeResult.from_dict(json.loads(line)) for line in complete.decode().splitlines() if line]

    def append(self, result: EpisodeResult) -> None:
        line = (json.dumps(result.to_dict()) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
