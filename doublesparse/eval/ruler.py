"""RULER-style synthetic long-context tasks: prompts built from a seed at a target length in
tokens, with lines of the eval plays as the haystack, and their exact-match scores.

Tasks (the answer strings each must produce):

- ``niah_single``: one "special magic number" for a key hidden in the text; its number.
- ``niah_multikey``: needles for several keys (the others are distractors); the number of the key asked.
- ``niah_multivalue``: several numbers for one key, spread over the text; all of them.
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = A``, ... spread over the text
  beside a distractor chain of another value; every variable of the chain that holds the value asked.
- ``cwe`` (common-words extraction): a numbered list of words, a few repeated many times, the
  others a few times; the most common ones.

Scoring as RULER's ``string_match_all``: per sample, the fraction of expected strings present
(case-insensitive) in the greedy output, then 100 x the mean over samples (points 0-100).

Lengths: the filler (haystack lines, or list entries for ``cwe``) is sized from the token cost
of 0 and 20 filler units, then trimmed until the prompt fits ``context_len`` (never over it).
Every random draw comes from ``random.Random`` seeded by (seed, task, length, index), so a sample
is the same prompt wherever it is built.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from itertools import pairwise

from doublesparse.texts import EVAL_PLAYS, encode, read_texts

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
# greedy tokens decoded per task (digits are often one token each)
GEN_TOKENS = {
    "niah_single": 16,
    "niah_multikey": 16,
    "niah_multivalue": 56,
    "vt": 40,
    "cwe": 48,
}
NUM_KEYS = 4  # niah_multikey: needles (1 asked, the rest distractors)
NUM_VALUES = 4  # niah_multivalue: numbers for the one key
CHAIN = 5  # vt: variables per chain
NUM_COMMON = 5  # cwe: words asked for
FREQ_COMMON, FREQ_RARE = 30, 3

_KEY_WORDS = (
    "amber",
    "brisk",
    "cedar",
    "dusky",
    "ember",
    "fable",
    "gusty",
    "hazel",
    "ivory",
    "jolly",
    "karma",
    "lunar",
    "maple",
    "noble",
    "olive",
    "pearl",
    "quill",
    "raven",
    "sable",
    "tulip",
    "umber",
    "vivid",
    "wheat",
    "xenon",
    "yodel",
    "zesty",
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."


@dataclass(frozen=True)
class Sample:
    """One prompt: ``ids`` (about ``context_len`` tokens, never more, ending with the answer
    prefix) and the strings the answer must contain."""

    task: str
    context_len: int
    index: int
    answers: tuple[str, ...]
    ids: tuple[int, ...] = field(repr=False)

    @property
    def gen_tokens(self) -> int:
        return GEN_TOKENS[self.task]


def haystack_lines(texts: list[str] | None = None) -> list[str]:
    """Non-empty lines of the eval plays (or of ``texts``), the filler of the needle tasks."""
    texts = read_texts(None, EVAL_PLAYS) if texts is None else texts
    return [ln.strip() for t in texts for ln in t.splitlines() if ln.strip()]


def vocabulary(lines: list[str]) -> list[str]:
    """Distinct lower-case words of 4+ letters in ``lines`` (sorted), the words of ``cwe``."""
    return sorted({w for ln in lines for w in re.findall(r"[a-z]{4,}", ln.lower())})


def _wrap(tokenizer, user: str, prefix: str) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if tmpl and hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return text + prefix
    return f"User: {user}\nAssistant: {prefix}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _key(rng: random.Random, taken: set) -> str:
    while True:
        k = f"{rng.choice(_KEY_WORDS)}-{rng.choice(_KEY_WORDS)}"
        if k not in taken:
            taken.add(k)
            return k


def _var(rng: random.Random, taken: set) -> str:
    while True:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in taken:
            taken.add(v)
            return v


class _Task:
    """A task's fixed draws (keys, values, depths) and ``text(units)``: the (user text, answer
    prefix) of a prompt with ``units`` filler units."""

    def __init__(
        self, task: str, rng: random.Random, lines: list[str], vocab: list[str]
    ):
        self.task, self.lines, self.rng = task, lines, rng
        self.start = rng.randrange(len(lines))
        taken: set = set()
        if task == "niah_single":
            k = _key(rng, taken)
            self.needles, self.answers = (
                [NEEDLE.format(key=k, value=(v := _number(rng)))],
                (v,),
            )
            self.question = f"What is the special magic number for {k} mentioned in the provided text?"
            self.prefix = (
                f"The special magic number for {k} mentioned in the provided text is"
            )
        elif task == "niah_multikey":
            pairs = [(_key(rng, taken), _number(rng)) for _ in range(NUM_KEYS)]
            k, v = pairs[rng.randrange(NUM_KEYS)]
            self.needles, self.answers = (
                [NEEDLE.format(key=a, value=b) for a, b in pairs],
                (v,),
            )
            self.question = f"What is the special magic number for {k} mentioned in the provided text?"
            self.prefix = (
                f"The special magic number for {k} mentioned in the provided text is"
            )
        elif task == "niah_multivalue":
            k = _key(rng, taken)
            vals = []
            while len(vals) < NUM_VALUES:
                v = _number(rng)
                vals += [v] if v not in vals else []
            self.needles, self.answers = (
                [NEEDLE.format(key=k, value=v) for v in vals],
                tuple(vals),
            )
            self.question = (
                f"What are all the special magic numbers for {k} mentioned in the provided "
                "text?"
            )
            self.prefix = (
                f"The special magic numbers for {k} mentioned in the provided text are"
            )
        elif task == "vt":
            val, other = _number(rng)[:5], _number(rng)[:5]
            while other == val:
                other = _number(rng)[:5]
            chains = [[_var(rng, taken) for _ in range(CHAIN)] for _ in range(2)]
            self.needles = [self._chain(c, x) for c, x in zip(chains, (val, other))]
            self.answers = tuple(chains[0])
            self.question = (
                f"Find all variables that are assigned the value {val} in the text above, "
                "directly or through other variables."
            )
            self.prefix = f"Answer: the variables assigned the value {val} are"
        elif task == "cwe":
            words = rng.sample(vocab, len(vocab))
            self.common, self.rare, self.freq = (
                words[:NUM_COMMON],
                words[NUM_COMMON:],
                FREQ_COMMON,
            )
            self.answers = tuple(self.common)
            self.question = (
                f"What are the {NUM_COMMON} most common words in the above list? "
                "Answer with the words only."
            )
            self.prefix = f"Answer: the {NUM_COMMON} most common words in the list are"
        else:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        self.depths = (
            sorted(rng.random() for _ in self.needles) if task != "cwe" else []
        )

    @staticmethod
    def _chain(names: list[str], value: str) -> list[str]:
        return [f"VAR {names[0]} = {value}."] + [
            f"VAR {b} = {a}." for a, b in pairwise(names)
        ]

    def text(self, units: int) -> tuple[str, str]:
        if self.task == "cwe":
            n_rare = min(units, len(self.rare))
            words = self.common * self.freq + self.rare[:n_rare] * FREQ_RARE
            random.Random(f"{self.start}-{units}").shuffle(words)
            body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            return (
                f"Below is a numbered list of words.\n{body}\n{self.question}",
                self.prefix,
            )
        hay = [self.lines[(self.start + i) % len(self.lines)] for i in range(units)]
        needles = [x for n in self.needles for x in (n if isinstance(n, list) else [n])]
        # chain links go in order at increasing depths; needles of one kind at their own depths
        depths = (
            sorted(self.depths + [self.depths[-1]] * (len(needles) - len(self.depths)))
            if self.task != "vt"
            else [
                i / len(needles) + self.depths[0] / (2 * len(needles))
                for i in range(len(needles))
            ]
        )
        order = (
            list(range(len(needles)))
            if self.task != "vt"
            else _interleave(len(self.needles[0]))
        )
        for d, j in sorted(zip(depths, order), reverse=True):
            hay.insert(round(d * len(hay)), needles[j])
        intro = (
            "Some special magic numbers are hidden inside the following text. Memorize them; "
            "I will ask about them.\n\n"
            if self.task != "vt"
            else "Memorize and track the chain(s) of variable assignments hidden in the following text.\n\n"
        )
        return intro + "\n".join(hay) + "\n\n" + self.question, self.prefix


def _interleave(n: int) -> list[int]:
    """Link order of two chains of ``n`` links placed alternately (A1 B1 A2 B2 ...)."""
    return [j for i in range(n) for j in (i, n + i)]


def _ids(tokenizer, t: _Task, units: int) -> list[int]:
    user, prefix = t.text(units)
    return encode(tokenizer, _wrap(tokenizer, user, prefix))


def make_sample(
    tokenizer,
    task: str,
    context_len: int,
    index: int = 0,
    seed: int = 0,
    lines: list[str] | None = None,
    vocab: list[str] | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at about ``context_len`` tokens (never more)."""
    lines = haystack_lines() if lines is None else lines
    vocab = vocabulary(lines) if vocab is None and task == "cwe" else (vocab or [])
    t = _Task(task, random.Random(f"{seed}/{task}/{context_len}/{index}"), lines, vocab)
    base = len(_ids(tokenizer, t, 0))
    while task == "cwe" and base > context_len // 2 and t.freq > FREQ_RARE + 2:
        t.freq = max(
            FREQ_RARE + 2, t.freq // 2
        )  # short contexts: fewer repeats of the common words
        base = len(_ids(tokenizer, t, 0))
    per = max(1.0, (len(_ids(tokenizer, t, 20)) - base) / 20)  # tokens per filler unit
    # the largest filler that fits, by bisection around the linear estimate (lines differ in length)
    lo, hi = 0, max(1, int((context_len - base) / per * 1.2) + 20)
    while len(_ids(tokenizer, t, hi)) <= context_len and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(_ids(tokenizer, t, mid)) <= context_len else (lo, mid)
    ids = _ids(tokenizer, t, lo)
    return Sample(task, context_len, index, t.answers, tuple(ids))


def make_samples(
    tokenizer,
    context_lens,
    tasks=TASKS,
    samples_per_task: int = 4,
    seed: int = 0,
    texts: list[str] | None = None,
) -> list[Sample]:
    """``samples_per_task`` samples of each task at each length."""
    lines = haystack_lines(texts)
    vocab = vocabulary(lines) if "cwe" in tasks else []
    return [
        make_sample(tokenizer, task, n, i, seed, lines, vocab)
        for n in context_lens
        for task in tasks
        for i in range(samples_per_task)
    ]


def score(output: str, answers) -> float:
    """Fraction of ``answers`` present in ``output`` (case-insensitive), in [0, 1]."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / max(len(answers), 1)
