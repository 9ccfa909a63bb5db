"""``episodes.jsonl``: one line per finished episode, appended as it finishes, so an interrupted evaluation
resumes where it stopped. Each line is one ``write`` of the whole line followed by ``fsync``; a line a kill cut
short is the last one and is ignored (and overwritten) on reading."""

from __future__ import annotations

from pathlib import Path

from roboscale.rollout.episode import EpisodeResult
from roboscale.utils.io import append_json_line, read_json_lines

EPISODES_FILE = "episodes.jsonl"


class EpisodeLog:
    def __init__(self, directory: Path):
        self.path = Path(directory) / EPISODES_FILE

    def read(self) -> list[EpisodeResult]:
        """The finished episodes; a torn last line is cut off the file so that appends start on a fresh line."""
        return [EpisodeResult.from_dict(record) for record in read_json_lines(self.path, repair=True)[0]]

    def append(self, result: EpisodeResult) -> None:
        append_json_line(self.path, result.to_dict())

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
