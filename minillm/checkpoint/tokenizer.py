"""Byte-level BPE tokenizer built with the `tokenizers` library from a GGUF file's vocabulary.

GPT-2 style BPE: text is split by a regex into words, each word's UTF-8 bytes are mapped to
printable characters, then the merges (ranked pairs) are applied greedily by rank. Control
tokens such as ``<|im_start|>`` are matched whole before any of that.
"""
from __future__ import annotations

from collections.abc import Sequence

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL = 3  # llama.cpp token_type of special (control) tokens

# SmolLM2's own template, used when a file carries none.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


class Tokenizer:
    """encode / decode / apply_chat_template, with HF's method names."""

    def __init__(self, backend: HFTokenizer, bos_token_id: int, eos_token_id: int,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self._template = jinja2.Environment().from_string(self.chat_template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise NotImplementedError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type", [])
        specials = [AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if t == CONTROL]
        backend.add_special_tokens(specials)
        return cls(backend, int(meta.get("tokenizer.ggml.bos_token_id", 1)),
                   int(meta.get("tokenizer.ggml.eos_token_id", 2)),
                   meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_folder(cls, folder, bos_token_id: int, eos_token_id: int) -> Tokenizer:
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        return cls(backend, bos_token_id, eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (no BOS is added: SmolLM2 does not use one)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.backend.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Render a conversation [{"role": ..., "content": ...}] with the model's template."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("messages must be dicts with 'role' and 'content'")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text
