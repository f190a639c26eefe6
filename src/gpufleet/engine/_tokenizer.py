"""A deterministic stand-in tokenizer: text to token ids, chat messages to a prompt, ids to filler.

The sim engine never runs a real model, but token counts drive everything it models (prefill
work, KV blocks, prefix-cache hits), so text must become ids the same way every time, on every
machine, and identical prefixes must give identical ids::

    tok = Tokenizer(vocab_size=128256)
    tok.encode("Hello, world!")            # (BOS, id("Hello"), id(","), id("world"), id("!"))
    tok.encode_chat([("user", "Hi")])      # BOS ⟨user⟩ id("Hi") ⟨end⟩ ⟨assistant⟩
    tok.decode([7, 8])                     # " chair dream": filler words, one per id

Text splits into pieces — runs of word characters, or single other non-space characters — and
a piece's id is a keyed BLAKE2b hash of its UTF-8 bytes, reduced into the ordinary id range
(Python's ``hash()`` is salted per process, so it would break determinism)::

    ids:   [ 0 … vocab_size − SPECIAL_IDS )  ordinary pieces (hashed)
           [ vocab_size − SPECIAL_IDS … vocab_size )  BOS, role markers, end of message

Generated ids map to words of a fixed list (``" " + WORDS[id % len(WORDS)]``). Every word is
one piece, so a generated text re-tokenizes to exactly as many ids as were generated.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterable, Sequence

SPECIAL_IDS = 16
"""Ids reserved at the top of the vocabulary for BOS, role markers and end of message."""

_PIECE = re.compile(r"\w+|[^\w\s]")
_CHUNK_CACHE = 1 << 16
_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
_BOS, _END, _OTHER_ROLE = 0, 1, 2  # offsets into the special range; roles follow at 3…

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her it an were are which
    this be or has had not but also first one their its new after who they have two been
    she other all time into more when year there would can over some out only between
    city most may people made later under during about world part where these then such
    state through both years three many well while known same each high since before what
    work early used could name area life long own often being house round small great best
    light river stone field water garden window paper music letter story morning evening
    summer winter spring autumn mountain valley forest ocean island bridge tower market
    village harbor station library museum theater kitchen table chair door wall floor roof
    road path street corner square circle line point shape color sound voice word number
    page book chapter figure image model value system method result change order level
    group family friend child parent teacher student doctor farmer worker artist writer
    green blue red yellow white black brown gray silver golden bright quiet gentle simple
    quick slow warm cold soft hard clear open close near far deep wide narrow heavy fresh
    walk run jump read write speak listen watch build carry bring follow begin finish hold
    dream cloud rain snow wind storm sun moon star sky earth fire iron glass wood salt bread
    """.split()  # noqa: SIM905 (a word list reads better as prose than as 242 literals)
)
"""Filler words for generated text: plain ASCII, one tokenizer piece each."""


@functools.lru_cache(maxsize=1 << 16)
def _piece_id(piece: str, modulus: int) -> int:
    digest = hashlib.blake2b(piece.encode(), digest_size=8, person=b"gpufleet-tok").digest()
    return int.from_bytes(digest, "little") % modulus


class Tokenizer:
    """Deterministic text ↔ id mapping for a vocabulary of ``vocab_size`` ids."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < SPECIAL_IDS + len(WORDS):
            raise ValueError(
                f"vocab_size must be at least {SPECIAL_IDS + len(WORDS)}, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self._ordinary = vocab_size - SPECIAL_IDS
        self.bos_id = self._ordinary + _BOS
        self.end_of_message_id = self._ordinary + _END
        self._role_ids = {role: self._ordinary + 3 + i for i, role in enumerate(_ROLES)}
        self._other_role_id = self._ordinary + _OTHER_ROLE
        names = ["<|begin_of_text|>", "<|end|>", "<|role|>", *(f"<|{r}|>" for r in _ROLES)]
        names += [f"<|reserved_{i}|>" for i in range(len(names), SPECIAL_IDS)]
        self._special_names = tuple(names)
        self._chunks: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, *, add_bos: bool = True) -> tuple[int, ...]:
        """Token ids of ``text``; a BOS id first unless ``add_bos`` is false.

        Pieces never span whitespace, so the ids of each whitespace-separated chunk are
        cached: text mostly repeats chunks, and a dict hit is ten times cheaper than the regex.
        """
        chunks = self._chunks
        if len(chunks) > _CHUNK_CACHE:
            chunks.clear()
        ids = [self.bos_id] if add_bos else []
        for chunk in text.split():
            known = chunks.get(chunk)
            if known is None:
                known = chunks[chunk] = self._chunk_ids(chunk)
            ids += known
        return tuple(ids)

    def _chunk_ids(self, chunk: str) -> tuple[int, ...]:
        modulus = self._ordinary
        return tuple(_piece_id(piece, modulus) for piece in _PIECE.findall(chunk))

    def encode_chat(self, messages: Iterable[tuple[str, str]]) -> tuple[int, ...]:
        """The chat template: BOS, then ⟨role⟩ content ⟨end⟩ per message, then ⟨assistant⟩.

        A role outside the known set gets one shared marker followed by the role's own
        pieces, so that different custom roles still tokenize differently.
        """
        ids = [self.bos_id]
        for role, content in messages:
            marker = self._role_ids.get(role)
            if marker is None:
                ids.append(self._other_role_id)
                ids.extend(self.encode(role, add_bos=False))
            else:
                ids.append(marker)
            ids.extend(self.encode(content, add_bos=False))
            ids.append(self.end_of_message_id)
        ids.append(self._role_ids["assistant"])
        return tuple(ids)

    @staticmethod
    def word_index(token_id: int) -> int:
        """Which of ``WORDS`` a generated id stands for."""
        return token_id % len(WORDS)

    def token_str(self, token_id: int) -> str:
        """What one id reads as (``/tokenize``'s ``token_strs``, ``/detokenize``): a special
        id's marker (``<|begin_of_text|>``, ``<|user|>``, …), any other id its filler word.

        Prompt ids are hashes and cannot be turned back into the text they came from.
        """
        if token_id < self._ordinary:
            return " " + WORDS[token_id % len(WORDS)]
        return self._special_names[token_id - self._ordinary]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """``token_str`` of every id, joined (special markers kept, as vLLM's default)."""
        return "".join(self.token_str(token_id) for token_id in token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Filler text for generated ids: a space and one word per id."""
        words = WORDS
        return "".join(" " + words[token_id % len(words)] for token_id in token_ids)

    def count(self, text: str) -> int:
        """How many ids ``encode(text, add_bos=False)`` gives, without hashing."""
        return len(_PIECE.findall(text))
