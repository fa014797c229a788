"""Text in and out of generate, where the model was uploaded with a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from tokenizers import Tokenizer

from compiler.errors import BadRequestError


class Text:
    def __init__(self, data: bytes) -> None:
        self.tokenizer = Tokenizer.from_str(data.decode())

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, as the tokenizer makes them (its special tokens included)."""
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise BadRequestError("text_input: the tokenizer makes no token of it")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def piece(self, ids: list[int], before: str) -> tuple[str, str]:
        """What the last of ``ids`` adds to ``before`` (the text of the ids before it), and the text of all of
        them: a character split across tokens arrives with the token that completes it."""
        text = self.decode(ids)
        return (text[len(before) :] if text.startswith(before) else text), text
