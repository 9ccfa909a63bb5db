"""``episodes.jsonl``: one line per finished episode, appended as it finishes, so an interrupted evaluation
resumes where it stopped. Each line is one ``write`` of the whole line followed by ``fsync``; a line a kill cut
short is the last one and is ignored (and overwritten) on reading. Any other line that is not an episode's
record was damaged: reading it is a one-line error naming the line."""

from __future__ import annotations

from pathlib import Path

from roboscale.errors import DatasetError
from roboscale.eval.records import dataclass_schema, json_lines, problem
from roboscale.rollout.episode import EpisodeResult
from roboscale.utils.io import append_json_line, read_json_lines

EPISODES_FILE = "episodes.jsonl"
EPISODE_FIELDS = dataclass_schema(EpisodeResult)
"""(required, optional) fields of an episode's record (its line here, and report.json's ``episodes``)."""
START_OVER = "fix or delete that line (its episode is then run again), or --resume=false to start over"


class EpisodeLog:
    def __init__(self, directory: Path):
        self.path = Path(directory) / EPISODES_FILE

    def read(self) -> list[EpisodeResult]:
        """The finished episodes; a torn last line is cut off the file so that appends start on a fresh line."""
        read_json_lines(self.path, repair=True)  # only for the repair: lines are read below, with their numbers
        results = []
        for number, record in json_lines(self.path, START_OVER):
            wrong = problem(record, *EPISODE_FIELDS)
            if wrong:
                raise DatasetError(self.path, f"line {number}: {wrong}; {START_OVER}")
            results.append(EpisodeResult.from_dict(record))
        return results

    def append(self, result: EpisodeResult) -> None:
        append_json_line(self.path, result.to_dict())

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
