"""``json_object`` that always closes: a JSON-object grammar whose matcher keeps enough of the
token budget to close the object, so the output parses whenever the request ends with "stop".

A plain JSON grammar lets a model run inside one string (or open object after object) until
``max_new_tokens`` cuts it, and the text never parses. Here a byte-level tracker follows the
generated JSON and knows the shortest text that closes it (``closing``: finish the open string,
escape, number or literal, give a pending key a ``:0``, close every container). With ``r`` tokens
left (this one included) and a closing of ``c`` bytes, the invariant is ``c + 1 <= r`` (the +1
is the stop token): a step may pick only tokens whose worst-case growth of the closing keeps it
(each byte's worst case is :data:`BYTE_GROWTH`; a token's is the sum over its bytes), and once
``c + 1 == r`` the closing itself is forced, one longest-matching token at a time (at least one
byte each, so ``c`` tokens at most). The closing uses only ASCII closers and UTF-8 continuation
bytes, which byte-level vocabularies hold as single tokens; a vocabulary lacking one gets the
plain grammar (``ClosingTable.usable`` is False).

Shapes: xgrammar's token bitmask is [n, ceil(V / 32)] int32, bit ``t % 32`` of word ``t // 32``
set when token ``t`` is allowed.
"""

from __future__ import annotations

import numpy as np

# The language: one JSON object, at most 20 whitespace characters per gap (blank lines cannot
# fill the budget). JsonTracker follows exactly this grammar.
GRAMMAR = r"""
root ::= object
object ::= "{" ws ( "}" | member ( ws "," ws member )* ws "}" )
member ::= string ws ":" ws value
value ::= object | array | string | number | "true" | "false" | "null"
array ::= "[" ws ( "]" | value ( ws "," ws value )* ws "]" )
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex )
hex ::= [0-9a-fA-F]
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
ws ::= [ \n\t]{0,20}
"""

# What a container still needs after its current element, by what it expects next.
_KEY_OR_END, _KEY, _COLON, _VALUE, _COMMA_OR_END, _VALUE_OR_END = range(6)
_NEED = {("o", _KEY_OR_END): b"}", ("o", _KEY): b'"":0}', ("o", _COLON): b":0}",
         ("o", _VALUE): b"0}", ("o", _COMMA_OR_END): b"}", ("a", _VALUE_OR_END): b"]",
         ("a", _VALUE): b"0]", ("a", _COMMA_OR_END): b"]"}
_DIGITS = frozenset(b"0123456789")
_WS = frozenset(b" \n\t\r")
# number states: whether the number may end here
_SIGN, _ZERO, _INT, _DOT, _FRAC, _EXP, _EXP_SIGN, _EXP_DIGITS = range(8)
_NUM_NEEDS_DIGIT = {_SIGN, _DOT, _EXP, _EXP_SIGN}


def _byte_growth() -> np.ndarray:
    """[256] int32: the most one byte can lengthen the closing, over every tracker state (checked
    against the tracker by the tests). ``,`` opens a member that needs ``"":0``; ``f`` after
    ``[`` needs ``alse``; a 4-byte UTF-8 lead needs its three continuation bytes."""
    g = np.zeros(256, dtype=np.int32)
    for chars, n in ((b",f", 4), (b'"utn', 3), (b"{[\\.-eE", 1)):
        for c in chars:
            g[c] = n
    g[0xC2:0xE0], g[0xE0:0xF0], g[0xF0:0xF5] = 1, 2, 3
    g[0xC0:0xC2] = g[0xF5:] = 4      # never valid UTF-8: the grammar refuses them anyway
    return g


BYTE_GROWTH = _byte_growth()


class JsonTracker:
    """Where a JSON object's text stands, byte by byte, and the shortest text that closes it."""

    def __init__(self) -> None:
        self.stack: list[list] = []     # [kind "o"/"a", what it expects next]
        self.started = False
        self.lex: tuple | None = None   # the token being read: ("str", esc, utf8), ("num", state),
                                        # ("lit", rest)
        self.utf8_first = 0x80          # the next continuation byte of a pending character

    @property
    def done(self) -> bool:
        return self.started and not self.stack

    def feed(self, data: bytes) -> None:
        for b in data:
            self._byte(b)

    def _byte(self, b: int) -> None:
        lex = self.lex
        if lex is not None:
            kind = lex[0]
            if kind == "str":
                self._string_byte(b)
                return
            if kind == "lit":
                self.lex = ("lit", lex[1][1:]) if len(lex[1]) > 1 else None
                return
            state = _number_next(lex[1], b)
            if state is not None:
                self.lex = ("num", state)
                return
            self.lex = None              # the number ended: b is structural
        if b in _WS:
            return
        if not self.started:             # the root "{"
            self.started = True
            self.stack.append(["o", _KEY_OR_END])
            return
        top = self.stack[-1]
        want = top[1]
        if b in b"}]":
            self.stack.pop()
        elif want == _COMMA_OR_END:      # ","
            top[1] = _KEY if top[0] == "o" else _VALUE
        elif want == _COLON:             # ":"
            top[1] = _VALUE
        elif top[0] == "o" and want in (_KEY_OR_END, _KEY):   # a key's opening quote
            top[1] = _COLON
            self.lex = ("str", None, 0)
        else:                            # a value starts
            top[1] = _COMMA_OR_END
            if b == ord("{"):
                self.stack.append(["o", _KEY_OR_END])
            elif b == ord("["):
                self.stack.append(["a", _VALUE_OR_END])
            elif b == ord('"'):
                self.lex = ("str", None, 0)
            elif b in b"tfn":
                self.lex = ("lit", {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}[b])
            else:
                self.lex = ("num", _SIGN if b == ord("-") else _ZERO if b == ord("0") else _INT)

    def _string_byte(self, b: int) -> None:
        _, esc, utf8 = self.lex
        if utf8:
            self.lex, self.utf8_first = ("str", esc, utf8 - 1), 0x80
        elif esc == "\\":
            self.lex = ("str", 0 if b == ord("u") else None, 0)
        elif esc is not None:            # hex digits of \uXXXX read so far
            self.lex = ("str", esc + 1 if esc < 3 else None, 0)
        elif b == ord('"'):
            self.lex = None
        elif b == ord("\\"):
            self.lex = ("str", "\\", 0)
        elif b >= 0xC0:
            n = 1 if b < 0xE0 else 2 if b < 0xF0 else 3
            self.lex = ("str", None, n)
            self.utf8_first = {0xE0: 0xA0, 0xF0: 0x90}.get(b, 0x80)

    def closing(self) -> bytes:
        """The shortest text (no whitespace) after which the object is complete."""
        if not self.started:
            return b"{}"
        out = b""
        if self.lex is not None:
            kind = self.lex[0]
            if kind == "str":
                _, esc, utf8 = self.lex
                if utf8:
                    out += bytes([self.utf8_first]) + b"\x80" * (utf8 - 1)
                elif esc == "\\":
                    out += b'"'          # an escaped quote
                elif esc is not None:
                    out += b"0" * (4 - esc)
                out += b'"'
            elif kind == "lit":
                out += self.lex[1]
            elif self.lex[1] in _NUM_NEEDS_DIGIT:
                out += b"0"
        top = True
        for kind, want in reversed(self.stack):
            out += _NEED[(kind, want)] if top else (b"}" if kind == "o" else b"]")
            top = False
        return out


def _number_next(state: int, b: int) -> int | None:
    """The number's state after byte b, or None when b is not part of it."""
    if b in _DIGITS:
        if state in (_SIGN,):
            return _ZERO if b == ord("0") else _INT
        if state == _INT:
            return _INT
        if state in (_DOT, _FRAC):
            return _FRAC
        if state in (_EXP, _EXP_SIGN, _EXP_DIGITS):
            return _EXP_DIGITS
        return None                      # a digit after a leading 0: not JSON
    if b == ord(".") and state in (_ZERO, _INT):
        return _DOT
    if b in b"eE" and state in (_ZERO, _INT, _FRAC):
        return _EXP
    if b in b"+-" and state == _EXP:
        return _EXP_SIGN
    return None


class ClosingTable:
    """Per vocabulary: each token's worst-case growth of the closing, the tokens that spell
    closings, and (cached) the bitmask of the tokens whose growth fits a given slack."""

    MAX_CLOSER = 8  # longest closing piece looked up as one token

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32
        toks = decoded_vocab[:vocab_size]
        lens = np.array([len(t) for t in toks], dtype=np.int64)
        ends = np.cumsum(lens)
        flat = np.frombuffer(b"".join(toks), dtype=np.uint8)
        running = np.concatenate([[0], np.cumsum(BYTE_GROWTH[flat], dtype=np.int64)])
        # ids past the tokenizer's vocabulary never fit (the grammar forbids them too)
        self.growth = np.full(self.words * 32, 2**30, dtype=np.int64)
        self.growth[:len(toks)] = running[ends] - running[ends - lens]
        self.max_growth = int(self.growth[:len(toks)].max(initial=0))
        closers = set(b'{"}]:0' + b"rueals" + b"\x80\x90\xa0")
        self.pieces = {tok: i for i, tok in enumerate(decoded_vocab[:vocab_size])
                       if tok and len(tok) <= self.MAX_CLOSER and set(tok) <= closers}
        self.usable = all(bytes([c]) in self.pieces for c in closers)
        self._fits: dict[int, np.ndarray] = {}

    def fits(self, slack: int) -> np.ndarray:
        """[words] uint32: the tokens whose growth is at most ``slack``."""
        m = self._fits.get(slack)
        if m is None:
            bits = np.packbits(self.growth <= slack, bitorder="little")
            m = self._fits[slack] = bits.view(np.uint32).copy()
        return m

    def first_piece(self, closing: bytes) -> int:
        """The token spelling the longest prefix of ``closing``."""
        for n in range(min(len(closing), self.MAX_CLOSER), 0, -1):
            tok = self.pieces.get(closing[:n])
            if tok is not None:
                return tok
        raise AssertionError(f"no token for {closing[:1]!r}")  # usable guarantees one


class BoundedJsonObject:
    """A GrammarMatcher over :data:`GRAMMAR` (same interface as xgrammar's, as the engine uses
    it) that closes the object within ``max_new_tokens``."""

    def __init__(self, matcher, table: ClosingTable, decoded_vocab: list[bytes],
                 max_new_tokens: int) -> None:
        self.m, self.table, self.vocab = matcher, table, decoded_vocab
        self.budget = max_new_tokens
        self.used = 0
        self.json = JsonTracker()

    def accept_token(self, tok: int) -> bool:
        ok = self.m.accept_token(tok)
        if ok:
            self.used += 1
            if not self.m.is_terminated():
                self.json.feed(self.vocab[tok])
        return ok

    def accept_string(self, text: str) -> bool:
        """Text already there (tests, benchmarks); it does not count against the budget."""
        ok = self.m.accept_string(text)
        if ok:
            self.json.feed(text.encode())
        return ok

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.json.done:
            return                       # the grammar allows only the stop token now
        closing = self.json.closing()
        slack = self.budget - self.used - 2 - len(closing)
        if slack >= self.table.max_growth:
            return
        words = bitmask[row].numpy().view(np.uint32)
        piece = self.table.first_piece(closing)
        if slack < 0:                    # exactly enough room left: close now
            words[:] = 0
        else:
            words &= self.table.fits(slack)[:words.shape[0]]
        words[piece // 32] |= np.uint32(1 << (piece % 32))


__all__ = ["BYTE_GROWTH", "BoundedJsonObject", "ClosingTable", "GRAMMAR", "JsonTracker"]
