"""Build a `tokenizers.Tokenizer` from the tokenizer metadata of a GGUF file.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and special
ids as `tokenizer.ggml.*` keys. `tokenizer.ggml.model` says which algorithm ("gpt2" = byte-level
BPE, "llama" = SentencePiece BPE with byte fallback) and `tokenizer.ggml.pre` names the
pre-tokenizer regex. The result mirrors transformers' GGUF converter
(transformers/integrations/gguf/gguf_tokenizer_mapping.py), except where llama.cpp's own
behaviour for a named pre-tokenizer is known to be closer to the original model's tokenizer.json
(SmolLM/StarCoder digit splitting, Llama-3 `ignore_merges`).

Host side only: no jax, no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type).
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6

# The GPT-2 regex, applied after llama.cpp's "\p{N}" split for these pre-tokenizer names: every
# digit is its own pre-token (the original SmolLM/StarCoder tokenizer.json: Digits + ByteLevel).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
SPLIT_REGEX_BY_PRE = {
    **{name: _LLAMA3_SPLIT for name in (*_LLAMA3_PRE, "dbrx", "smaug-bpe", "jina-v5-nano")},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "kormo", "megrez")},
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **{name: _GPT4O_SPLIT for name in ("gpt-4o", "llama4", "minimax-m2")},
}
# llama.cpp sets ignore_merges for its LLAMA3 pre-tokenizer type (as Llama 3's tokenizer.json does).
_IGNORE_MERGES_PRE = set(_LLAMA3_PRE)


@dataclass
class GGUFTokenizerData:
    """The `tokenizer.*` metadata of a GGUF file, decoded to Python values."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None
    extra: dict = field(default_factory=dict)


def _field_value(f):
    """Decode one GGUFReader field: scalar, string, or array of either."""
    from gguf import GGUFValueType

    types = list(f.types)
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    value = f.parts[f.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


def read_gguf_tokenizer(path_or_reader) -> GGUFTokenizerData:
    """Read the tokenizer metadata from a GGUF path or an open `gguf.GGUFReader`."""
    if isinstance(path_or_reader, (str, bytes)) or hasattr(path_or_reader, "__fspath__"):
        from gguf import GGUFReader

        reader = GGUFReader(path_or_reader)
    else:
        reader = path_or_reader
    fields = reader.fields

    def get(key, default=None):
        return _field_value(fields[key]) if key in fields else default

    if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
        raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = get("tokenizer.ggml.tokens")
    return GGUFTokenizerData(
        model=get("tokenizer.ggml.model"),
        pre=get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens),
        scores=get("tokenizer.ggml.scores"),
        merges=get("tokenizer.ggml.merges"),
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        unk_token_id=get("tokenizer.ggml.unknown_token_id"),
        pad_token_id=get("tokenizer.ggml.padding_token_id"),
        add_bos_token=get("tokenizer.ggml.add_bos_token"),
        add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=get("tokenizer.chat_template"),
        extra={"architecture": get("general.architecture")},
    )


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    out = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if merge.count(" ") > 1:  # a piece holds a literal space: pick the split both sides know
            for i in (i for i, c in enumerate(merge) if c == " "):
                if merge[:i] in vocab and merge[i + 1 :] in vocab:
                    left, right = merge[:i], merge[i + 1 :]
                    break
        out.append((left, right))
    return out


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two known pieces,
    best-scored merged token first (transformers' `generate_merges`)."""
    merges = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(data.tokens):
        if not set(token) <= alphabet:  # stored as raw text: respell in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = _split_merges(data.merges or [], vocab)
    bpe = models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, byte_fallback=False, ignore_merges=data.pre in _IGNORE_MERGES_PRE,
    )
    tok = Tokenizer(bpe)
    split = SPLIT_REGEX_BY_PRE.get(data.pre)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif data.pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        if data.pre not in (None, "default", "gpt2", "gpt-2"):
            logger.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 regex", data.pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    vocab = {}
    for index, token in enumerate(data.tokens):
        vocab.setdefault(token, index)
    if data.merges:
        merges = _split_merges(data.merges, vocab)
    else:
        if data.scores is None:
            raise ValueError("GGUF llama tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
        # Control/byte/unknown tokens never come out of a merge.
        scores = {t: s for t, s, ty in zip(data.tokens, data.scores, data.token_types) if ty in (1, 4, 5)}
        merges = generate_merges(vocab, scores)
    unk = data.tokens[data.unk_token_id] if data.unk_token_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                               dropout=None))
    prefix = data.add_space_prefix
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


_BUILDERS = {"gpt2": _byte_level_tokenizer, "llama": _sentencepiece_tokenizer}


def build_gguf_tokenizer(data: GGUFTokenizerData) -> Tokenizer:
    """The backend tokenizer for `data`, with control tokens added as special tokens, user-defined
    tokens as plain added tokens, and BOS/EOS inserted by the post-processor as the file says."""
    builder = _BUILDERS.get(data.model)
    if builder is None:
        raise ValueError(
            f"unsupported GGUF tokenizer model tokenizer.ggml.model={data.model!r}; supported: {sorted(_BUILDERS)}"
        )
    tok = builder(data)
    byte_level = data.model == "gpt2"
    alphabet = set(bytes_to_unicode().values())
    vocab = tok.get_vocab(with_added_tokens=False)
    control, user = [], []
    for token, ty in zip(data.tokens, data.token_types):
        if ty == TOKEN_TYPE_CONTROL and (not byte_level or set(token) <= alphabet):
            control.append(AddedToken(token, normalized=False, special=True))
        elif ty == TOKEN_TYPE_USER_DEFINED and token in vocab:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    add_bos = data.add_bos_token if data.add_bos_token is not None else data.model == "llama"
    set_bos_eos_post_processor(tok, data.bos_token_id if add_bos else None,
                               data.eos_token_id if data.add_eos_token else None)
    return tok


def set_bos_eos_post_processor(tok: Tokenizer, bos_id: int | None, eos_id: int | None) -> None:
    """Make `encode(..., add_special_tokens=True)` prepend `bos_id` / append `eos_id` (None: don't)."""
    if bos_id is None and eos_id is None:
        tok.post_processor = None
        return
    bos = [(tok.id_to_token(bos_id), bos_id)] if bos_id is not None else []
    eos = [(tok.id_to_token(eos_id), eos_id)] if eos_id is not None else []
    single = ([bos[0][0]] if bos else []) + ["$A"] + ([eos[0][0]] if eos else [])
    pair = single + ([bos[0][0]] if bos else []) + ["$B:1"] + ([eos[0][0]] if eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=sorted(set(bos + eos))
    )
