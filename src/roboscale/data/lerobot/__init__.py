"""The LeRobot v3.0 format: the on-disk layout (``format``), reading with LeRobot's item semantics (``reader``),
writing datasets LeRobot loads (``writer``), converting v2.0/v2.1 (``convert``), checking every file
(``validate``), feature statistics (``stats``) and the video and PNG codecs (``video``)."""
