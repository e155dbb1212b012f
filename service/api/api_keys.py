"""The API keys this server accepts, and who offered one.

Keys come from ``OPTIREMAT_API_KEYS`` and, one a line, from
``OPTIREMAT_API_KEYS_FILE`` (blank lines and ``#`` comments skipped). The file is
read again when it changes, checked at most once a second, so a rotated Kubernetes
Secret takes effect without a restart; a file that cannot be read keeps the keys
read last.

An offered key is hashed and its digest compared with every key's digest in
constant time: how long a check takes says neither which key matched nor how much
of one. A key is known by its ``key_id``, a prefix of its digest: it names the
owner of a job and a rate-limit bucket without the key itself being kept.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from optiremat.service.core.config import Settings

log = logging.getLogger("optiremat.service")
_RECHECK_S = 1.0  # a stat() per second at most, however many requests


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _read_keys(path: Path) -> tuple[str, ...]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


class ApiKeys:
    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = settings.auth
        self._inline = settings.api_keys
        self._path = settings.api_keys_file
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at = -_RECHECK_S
        self._file_stamp: tuple[int, int] | None = None
        self._digests: list[tuple[bytes, str]] = []
        self._load(self._inline)
        self._refresh()

    def _load(self, keys: tuple[str, ...]) -> None:
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k))
                         for k in dict.fromkeys(keys)]

    def _refresh(self) -> None:
        if self._path is None:
            return
        with self._lock:
            now = self._clock()
            if now - self._checked_at < _RECHECK_S:
                return
            self._checked_at = now
            try:
                stat = self._path.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
                if stamp == self._file_stamp:
                    return
                keys = _read_keys(self._path)
            except OSError as exc:
                log.warning("cannot read OPTIREMAT_API_KEYS_FILE %s (%s); keeping the keys "
                            "read before", self._path, exc)
                return
            self._file_stamp = stamp
            self._load(self._inline + keys)
            log.info("read %d API keys from %s", len(keys), self._path)

    def owner(self, offered: str) -> str | None:
        """The ``key_id`` of the key ``offered`` is, or None when it is none of them."""
        self._refresh()
        digest = hashlib.sha256(offered.encode()).digest()
        matched = None
        for known, known_id in self._digests:  # no early exit: every key costs the same
            if hmac.compare_digest(digest, known):
                matched = known_id
        return matched
