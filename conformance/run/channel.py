"""The events channel from an isolated worker to its parent: one line per event, numbered and
signed with a key only the parent and the harness side of the worker hold.

The backend runs in the worker's process, next to the file the events go to. A backend that by
accident writes into that file (a stray log handler, a reused path, a library printing to an
inherited descriptor) must not be able to add, drop or reorder a verdict unnoticed: a line whose
signature does not verify, a sequence number out of order, or a file that shrank is reported as
tampering instead of being read as an event. (A backend written to cheat can read the key from its
own process's memory; see the threat model in docs/gating.md.)

A line is ``SEQ MAC JSON``: MAC is HMAC-SHA256 over ``SEQ JSON`` with the run's key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Any, TextIO

KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, seq: int, body: str) -> str:
    return hmac.new(key, f"{seq} {body}".encode(), hashlib.sha256).hexdigest()


class ChannelWriter:
    """The worker's side: ``emit`` writes and flushes one signed line per event."""

    def __init__(self, stream: TextIO, key: bytes) -> None:
        self.stream, self.key, self.seq = stream, key, 0

    def emit(self, event: dict[str, Any]) -> None:
        self.seq += 1
        body = json.dumps(event)
        self.stream.write(f"{self.seq} {_mac(self.key, self.seq, body)} {body}\n")
        self.stream.flush()


TAMPERING = "tampering"  # the kind of the reader's own notice: {"event": "tampering", "what": ...}


class ChannelReader:
    """The parent's side: ``read`` returns the new events in file order, each line that does not
    verify as a notice of the reader's own, ``{"event": "tampering", "what": ...}`` (no worker
    can send that kind: the reader makes it)."""

    def __init__(self, stream: TextIO, key: bytes) -> None:
        self.stream, self.key = stream, key
        self.partial = ""
        self.expected = 1

    def read(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        position = self.stream.tell()
        if os.fstat(self.stream.fileno()).st_size < position:
            events.append(_tampering(f"the events file shrank below the {position} bytes already read"))
            self.stream.seek(0, os.SEEK_END)
            self.partial = ""
        lines = (self.partial + self.stream.read()).split("\n")
        self.partial = lines.pop()  # a line still being written
        for line in filter(None, lines):
            events += self._verify(line)
        return events

    def _verify(self, line: str) -> list[dict[str, Any]]:
        seq_text, _, rest = line.partition(" ")
        mac, _, body = rest.partition(" ")
        shown = line[:120] + ("…" if len(line) > 120 else "")
        if not (seq_text.isdigit() and hmac.compare_digest(mac, _mac(self.key, int(seq_text), body))):
            return [_tampering(f"a line the harness did not write: {shown!r}")]
        seq = int(seq_text)
        if seq < self.expected:
            return [_tampering(f"event {seq} arrived again after event {self.expected - 1} (a repeated line)")]
        notices = (
            []
            if seq == self.expected
            else [_tampering(f"events {self.expected} to {seq - 1} never arrived (lines removed)")]
        )
        self.expected = seq + 1
        return notices + [json.loads(body)]


def _tampering(what: str) -> dict[str, Any]:
    return {"event": TAMPERING, "what": what}
