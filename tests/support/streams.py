"""One streamed gRPC request in a thread, as a client of a live server sees it (the reliability
tests fault the server while such streams are in flight)."""

from __future__ import annotations

import threading
import time

from raypaged.client import Client, RequestError


class Stream:
    """One streamed request in a thread: each sample's tokens, text, logprobs, finish."""

    def __init__(self, address: str, prompt: list[int], **params) -> None:
        n = params.get("n", 1)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.error: RequestError | None = None
        self.ended_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(address, prompt, params), daemon=True)
        self._thread.start()

    def _run(self, address: str, prompt: list[int], params: dict) -> None:
        try:
            with Client(address) as client:
                for chunk in client.stream(prompt, timeout=300, **params):
                    for out in chunk.outputs:
                        self.tokens[out.index] += out.token_ids
                        self.text[out.index] += out.text
                        self.logprobs[out.index] += out.logprobs or []
                        self.finish[out.index] = out.finish_reason or self.finish[out.index]
        except RequestError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def wait_tokens(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(len(t) for t in self.tokens) < count:
            assert self.ended_at is None, f"the stream ended early: {self.error}"
            assert time.monotonic() < deadline
            time.sleep(0.002)

    def join(self, timeout_s: float = 180.0) -> Stream:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream hangs"
        return self
