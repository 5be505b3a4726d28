"""What one request and one client may hold, and whose request an id names.

* Choices per request: an OpenAI request fans out into prompts x best_of engine requests (best_of
  defaults to n); past ``--max-choices-per-request`` it is refused with a 400 naming the field.
* One client's share: engine requests a client (its address) has accepted and unfinished; past
  ``--max-requests-per-client`` a new request gets a 429 (``Retry-After``), so one client cannot
  fill the queue for everybody else. Counted per choice from acceptance until it ends.
* Request identity: the engine only sees ids the server made. A client's own ``rid`` (SGLang's
  ``/generate`` field) is a label in that client's scope: reusing one that is still running gets
  a 400 and leaves the original alone, and another client's identical ``rid`` is a different
  request. Nothing takes a client ``rid`` to abort, read or join a request.

Everything here runs on the event loop (no locks).
"""

from __future__ import annotations

from typing import Callable

from starlette.requests import Request

from doublesparse.server.protocol import APIError


def client_key(request: Request) -> str:
    """The client a request counts against: its peer address (a proxy in front makes every
    client one; raise the limit there)."""
    c = request.client
    return c.host if c is not None else "unknown"


class Admission:
    def __init__(self, max_choices: int | None, max_per_client: int | None) -> None:
        self.max_choices, self.max_per_client = max_choices, max_per_client
        self.load: dict[str, int] = {}          # client -> engine requests accepted, unfinished
        self._rids: set[tuple[str, str]] = set()  # (client, client rid) still running

    def check_choices(self, prompts: int, n: int, best_of: int | None) -> int:
        """Engine requests of one OpenAI request; a 400 past the limit."""
        per = max(n, best_of or n)
        total = prompts * per
        if self.max_choices is not None and total > self.max_choices:
            param = "best_of" if best_of and best_of > n else ("n" if n > 1 else "prompt")
            what = f"{prompts} prompt(s) x {'best_of' if param == 'best_of' else 'n'} {per}"
            raise APIError(f"this request asks for {total} samples ({what}); this server allows "
                           f"at most {self.max_choices} per request", param=param,
                           code="too_many_choices")
        return total

    def acquire(self, client: str, k: int) -> Callable[[], None]:
        """Count ``k`` engine requests against ``client`` (429 past its share); returns the
        release for one of them (each choice calls it once, when it ends)."""
        have = self.load.get(client, 0)
        if self.max_per_client is not None and have + k > self.max_per_client:
            raise APIError(f"too many requests in flight from this client: {have} accepted and "
                           f"unfinished, this request would add {k}, the limit is "
                           f"{self.max_per_client}; retry when some have finished", status=429,
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.load[client] = have + k

        def release() -> None:
            left = self.load.get(client, 0) - 1
            if left > 0:
                self.load[client] = left
            else:
                self.load.pop(client, None)
        return release

    def claim_rid(self, client: str, rid: str) -> Callable[[], None]:
        """Reserve a client's ``rid`` while its request runs; a 400 if it is running already."""
        key = (client, rid)
        if key in self._rids:
            raise APIError(f"rid {rid!r} is already in use by a running request of yours; send a "
                           "new rid (the running one is not affected)", param="rid",
                           code="duplicate_rid")
        self._rids.add(key)
        return lambda: self._rids.discard(key)
