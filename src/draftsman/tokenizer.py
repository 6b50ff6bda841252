"""Tokenizers and chat templates, through HF transformers (never re-implemented here)."""

from __future__ import annotations

import json
from pathlib import Path

# Files that define tokenization and the chat template (transformers 5 may keep the template in
# chat_template.jinja), so a fingerprint over them changes whenever loss masks could.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's HF tokenizer, or None when the directory ships none."""
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text`; with chat=True, rendered as one user turn by the tokenizer's chat
    template, ending with the assistant generation prompt."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat: this tokenizer has no chat template (tokenizer_config.json)")
        rendered = tokenizer.apply_chat_template(chat_messages(text), add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)


def eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...], tokenizer=None) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids = set(config_eos)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids |= set(eos) if isinstance(eos, list) else {eos}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
