"""Small engines for the server's tests and dry runs.

:class:`FakeEngine` is a deterministic stand-in for ``doublesparse.engine.Engine``: it implements
the same contract the server relies on (add_request / step / abort / has_unfinished / stats /
tokenizer / max_context_len) with a character-level tokenizer and a hash-based "model", so server
behaviour (batching, KV admission, aborts, streaming, metrics) can be tested in milliseconds
without torch. Select it with ``--engine-factory doublesparse.server.fake_engine:FakeEngine``.
:func:`tiny_engine` is the real engine on a tiny random model.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..engine.scheduler import FairQueue
from ..engine.request import StepOutput

EOS_ID = 2
_OFFSET = 3  # ids 0..2 are reserved (pad, bos, eos); characters map to ord(c) + 3
_ALPHABET = "abcdefghij "


class FakeTokenizer:
    """Character tokenizer with a minimal chat template (enough for ``apply_chat_template``)."""

    eos_token_id = EOS_ID
    vocab_size = 0x110000 + _OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) + _OFFSET for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - _OFFSET) for i in ids if i >= _OFFSET)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True,
                            **_: object):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


@dataclass
class FakeSamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    enable_double_sparsity: bool | None = None
    ds_heavy_token_num: int | None = None


@dataclass
class _PlainSamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0


# Same record the real engine returns, so server code sees one type.
FakeStepOutput = StepOutput


@dataclass
class _Req:
    rid: str
    ids: list[int]
    sp: FakeSamplingParams
    prompt_len: int
    rng: random.Random
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    group: str = ""


class FakeEngine:
    """Continuous-batching toy engine. KV slots are reserved up front (prompt + max_new_tokens),
    so a full pool makes new requests wait instead of failing mid-generation. Admission is the
    real scheduler's: fair across groups (round robin, :class:`FairQueue`), the last running slot
    kept for a group with nothing running, no overtaking of a head that does not fit."""

    sampling_params_cls = FakeSamplingParams

    def __init__(self, max_total_tokens: int | None = 4096, max_context_len: int = 2048,
                 step_delay: float = 0.005, max_running_requests: int = 64,
                 enable_double_sparsity: bool | None = True, per_request_ds: bool = True,
                 fail_marker: str | None = None, load_delay: float = 0.0,
                 load_error: str | None = None, **_: object) -> None:
        # fail_marker: step() raises while a prompt containing it runs (engine-failure tests).
        self.fail_marker = fail_marker
        # load_delay / load_error: a model that takes that long to load / then fails (ValueError)
        time.sleep(float(load_delay or 0.0))
        if load_error:
            raise ValueError(load_error)
        # per_request_ds=False mimics an engine whose SamplingParams lacks the DS overrides.
        if not per_request_ds:
            self.sampling_params_cls = _PlainSamplingParams
        # The CLI passes unset flags as None: fall back to the defaults then.
        max_running_requests = max_running_requests or 64
        max_context_len = max_context_len or 2048
        self.tokenizer = FakeTokenizer()
        self.max_context_len = max_context_len
        self.model_config = SimpleNamespace(name="fake-model", max_position_embeddings=max_context_len)
        self.kv_total = int(max_total_tokens or 4096)
        self.step_delay = float(step_delay or 0.0)
        self.max_running = max_running_requests
        self.enable_ds = enable_double_sparsity is not False
        self.waiting: FairQueue[_Req] = FairQueue()
        self.running: list[_Req] = []
        self.group_running: Counter = Counter()
        self.kv_used = 0
        self.counters = dict(decode_steps_total=0, decode_steps_sparse=0, prompt_tokens_total=0,
                             generation_tokens_total=0)
        self._next_id = 0

    # --- contract -------------------------------------------------------------------------
    def add_request(self, prompt, sampling_params, request_id: str | None = None,
                    group: str | None = None) -> str:
        sp = sampling_params if isinstance(sampling_params, FakeSamplingParams) else \
            FakeSamplingParams(**dict(sampling_params or {}))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) + sp.max_new_tokens > min(self.max_context_len, self.kv_total):
            raise ValueError("prompt plus max_new_tokens exceeds the context window")
        if request_id is None:
            self._next_id += 1
            request_id = f"fake-{self._next_id}"
        seed = sp.seed if sp.seed is not None else hash(request_id)
        if request_id in self.waiting or any(r.rid == request_id for r in self.running):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.waiting.add(request_id, group or request_id,
                         _Req(request_id, ids, sp, len(ids), random.Random(seed), group=group or request_id))
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self.waiting:
            self.waiting.remove(request_id)
            return
        for r in self.running:
            if r.rid == request_id:
                self._release(r)
                return

    def _release(self, r: _Req) -> None:
        self.running.remove(r)
        self.kv_used -= self._need(r)
        self.group_running[r.group] -= 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[FakeStepOutput]:
        while self.waiting and len(self.running) < self.max_running:
            last = 0 < len(self.running) == self.max_running - 1
            r = self.waiting.head((lambda g: self.group_running[g] > 0) if last else None)
            if r is None or self.kv_used + self._need(r) > self.kv_total:
                break  # the head waits until it fits
            self.waiting.take(r.rid)
            self.group_running[r.group] += 1
            self.kv_used += self._need(r)
            self.counters["prompt_tokens_total"] += r.prompt_len
            self.running.append(r)
        if not self.running:
            return []
        if self.fail_marker and any(self.fail_marker in self.tokenizer.decode(r.ids[:r.prompt_len])
                                    for r in self.running):
            raise RuntimeError("injected engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.counters["decode_steps_total"] += 1
        if self.enable_ds:
            self.counters["decode_steps_sparse"] += 1
        outs = []
        for r in list(self.running):
            tok = self._next_token(r)
            r.ids.append(tok)
            r.out_ids.append(tok)
            self.counters["generation_tokens_total"] += 1
            delta = self.tokenizer.decode([tok])
            finish = None
            if tok == EOS_ID and not r.sp.ignore_eos:
                finish, delta = "stop", ""
            elif tok in r.sp.stop_token_ids:
                finish = "stop"
            else:
                text = r.text + delta
                for s in r.sp.stop:
                    if s and s in text:
                        finish, delta = "stop", text[: text.index(s)][len(r.text):]
                        break
            r.text += delta
            if finish is None and len(r.out_ids) >= r.sp.max_new_tokens:
                finish = "length"
            if finish:
                self._release(r)
            outs.append(FakeStepOutput(r.rid, [tok], delta, finish is not None, finish,
                                       r.prompt_len, len(r.out_ids)))
        return outs

    def stats(self) -> dict:
        return dict(running=len(self.running), waiting=len(self.waiting), kv_used_tokens=self.kv_used,
                    kv_total_tokens=self.kv_total, **self.counters)

    def generate(self, prompt, sampling_params) -> str:
        """Offline run of one request (used as the reference in tests)."""
        rid = self.add_request(prompt, sampling_params)
        text = ""
        while self.has_unfinished():
            for o in self.step():
                if o.request_id == rid:
                    text += o.text
        return text

    # --- internals ------------------------------------------------------------------------
    @staticmethod
    def _need(r: _Req) -> int:
        return r.prompt_len + r.sp.max_new_tokens

    def _next_token(self, r: _Req) -> int:
        h = (sum(r.ids[-4:]) * 31 + len(r.ids) * 7) % 1000
        if h == 999:
            return EOS_ID
        if r.sp.temperature == 0:
            c = _ALPHABET[h % len(_ALPHABET)]
        else:
            c = r.rng.choice(_ALPHABET)
        return ord(c) + _OFFSET


def tiny_engine(seed: int = 0, max_position_embeddings: int = 1024, vocab_size: int | None = None, **engine_kw):
    """The real engine (``doublesparse.Engine``) on :func:`~doublesparse.testing.tiny_llama` with
    :class:`~doublesparse.testing.ChatByteTokenizer`, on the CPU: a server backend that answers in
    milliseconds (``--engine-factory doublesparse.server.fake_engine:tiny_engine``). ``engine_kw``:
    EngineConfig fields; ``vocab_size`` (default: the byte tokenizer's) gives a real model's
    logits rows and token-id range (``--engine-kwargs '{"vocab_size": 128256}'``)."""
    from ..api import Engine
    from ..testing import ChatByteTokenizer, tiny_llama

    engine_kw = {k: v for k, v in engine_kw.items() if v is not None}
    engine_kw["device"] = "cpu"
    engine_kw.setdefault("context_length", max_position_embeddings)
    extra = {} if vocab_size is None else {"vocab_size": vocab_size}
    model = tiny_llama(seed=seed, max_position_embeddings=max_position_embeddings, **extra)
    engine = Engine(model=model, tokenizer=ChatByteTokenizer(), progress=False, **engine_kw)
    engine.model_name = "tiny-llama"  # the id the server serves it under
    return engine
