"""load_tokenizer on real checkpoint folders as downloaded (no weights): Dream and SDAR ship Qwen2
byte-level BPE as vocab.json + merges.txt; the LLaDA reference folders ship no tokenizer model at all.
transformers' own Qwen2Tokenizer, loaded from the same folder, is the oracle for ids and templates.
The tokenizer files live in ../shared/reference/checkpoints (tests that need them skip without it);
config.json is read from tests/reference."""
import json
import warnings
from pathlib import Path

import pytest

from dare_core.models.tokenizer import load_tokenizer
from reference_metadata import config as reference_config, shared_checkpoint

DREAM, SDAR8 = "Dream-v0-Instruct-7B", "SDAR-8B-Chat"
# folder -> (eos, pad, mask, bos)
SPECIAL_IDS = {
    DREAM: (151643, 151643, 151666, 151665),
    "SDAR-1dot7B-Chat": (151643, 151643, 151669, None),
    "SDAR-4B-Chat": (151643, 151643, 151669, None),
    SDAR8: (151643, 151643, 151669, None),
    "SDAR-30B-A3B-Chat": (151643, 151643, 151669, None),
}
TEXTS = ["Hello, world! How are you?", "héllo 世界", "12345", "a<|im_end|>b", "  two  spaces\nand\n\nlines\t",
         "<|im_start|>user\nhi<|im_end|>\n", "naïve café — ok?"]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <a> & b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]
TOOL_CHAT = [{"role": "user", "content": "1+2?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
             {"role": "tool", "content": "3"}]


@pytest.fixture(scope="module")
def ours():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_tokenizer(shared_checkpoint(name))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def oracle():
    transformers = pytest.importorskip("transformers")
    cache = {}

    def get(name):
        if name not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # The class itself, never AutoTokenizer: Dream's auto_map names remote code.
                cache[name] = transformers.Qwen2Tokenizer.from_pretrained(str(shared_checkpoint(name)))
        return cache[name]
    return get


@pytest.mark.parametrize("name", sorted(SPECIAL_IDS))
def test_special_token_ids(ours, name):
    tok = ours(name)
    eos, pad, mask, bos = SPECIAL_IDS[name]
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id, tok.bos_token_id) == (eos, pad, mask, bos)
    assert tok.eot_token_id == tok.backend.token_to_id("<|im_end|>") == 151645
    added = json.loads((shared_checkpoint(name) / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for tid, entry in added.items():
        assert tok.backend.token_to_id(entry["content"]) == int(tid)
    assert tok.vocab_size == max(map(int, added)) + 1


def test_sdar_30b_mask_comes_from_the_added_tokens():
    # Its config.json has no mask_token_id: the id must come from the tokenizer's <|MASK|>.
    assert "mask_token_id" not in reference_config("SDAR-30B-A3B-Chat")


@pytest.mark.parametrize("name", [DREAM, SDAR8])
def test_encoding_matches_transformers(ours, oracle, name):
    tok, ref = ours(name), oracle(name)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("a<|im_end|>b")[1] == 151645  # a special token written literally is one token
    ref_added = {i: (t.content, t.special) for i, t in ref.backend_tokenizer.get_added_tokens_decoder().items()}
    our_added = {i: (t.content, t.special) for i, t in tok.backend.get_added_tokens_decoder().items()}
    assert our_added == ref_added


@pytest.mark.parametrize("name", [DREAM, SDAR8])
def test_chat_template_matches_transformers(ours, oracle, name):
    tok, ref = ours(name), oracle(name)
    for messages in CHATS:
        for gen in (True, False):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    want = ref.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(TOOL_CHAT, tools=TOOLS) == want


def test_template_keywords_reach_the_template(ours, oracle):
    tok, ref = ours(SDAR8), oracle(SDAR8)
    chat = CHATS[0]
    want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert tok.apply_chat_template(chat, enable_thinking=False) == want
    assert want.endswith("<think>\n\n</think>\n\n")


def test_sdar_template_comes_from_chat_template_jinja(ours):
    # SDAR-30B's tokenizer_config.json has no chat_template; only the .jinja file does.
    assert "chat_template" not in json.loads((shared_checkpoint("SDAR-30B-A3B-Chat") / "tokenizer_config.json").read_text())
    text = ours("SDAR-30B-A3B-Chat").apply_chat_template(CHATS[0])
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["LLaDA-8B-Instruct", "LLaDA2.0-mini", "LLaDA2.1-mini"])
def test_folder_without_tokenizer_model_is_a_clear_error(name):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json, or vocab\.json \+ merges\.txt"):
        load_tokenizer(shared_checkpoint(name))


# ---- small synthetic folders: the error paths and the older added_tokens.json layout

def _tiny_bpe(folder: Path, config: dict, added_tokens: dict = None) -> Path:
    folder.mkdir()
    vocab = {c: i for i, c in enumerate("abcdĠ")}
    vocab["ab"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer", **config}))
    if added_tokens is not None:
        (folder / "added_tokens.json").write_text(json.dumps(added_tokens))
    return folder


def _entry(content, special=True):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def test_tiny_bpe_with_added_tokens_decoder(tmp_path):
    config = {"eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
              "added_tokens_decoder": {"6": _entry("<|endoftext|>"), "7": _entry("<|mask|>", special=False)}}
    tok = load_tokenizer(_tiny_bpe(tmp_path / "t", config))
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (6, 6, 7)
    assert tok.encode("ab c<|mask|>") == [5, 4, 2, 7]
    assert tok.decode(tok.encode("ab c<|mask|>")) == "ab c"  # the mask is special: named as mask_token


def test_added_tokens_json_fallback(tmp_path):
    config = {"eos_token": "<|endoftext|>", "additional_special_tokens": ["<|mask|>"]}
    tok = load_tokenizer(_tiny_bpe(tmp_path / "t", config, {"<|mask|>": 7, "<|endoftext|>": 6}))
    assert (tok.eos_token_id, tok.mask_token_id) == (6, 7)


def test_added_token_ids_that_do_not_fit_are_an_error(tmp_path):
    config = {"eos_token": "<|endoftext|>", "added_tokens_decoder": {"9": _entry("<|endoftext|>")}}
    with pytest.raises(ValueError, match="records 9"):
        load_tokenizer(_tiny_bpe(tmp_path / "t", config))


def test_merges_without_vocab_names_the_missing_file(tmp_path):
    folder = _tiny_bpe(tmp_path / "t", {"eos_token": "a"})
    (folder / "vocab.json").unlink()
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        load_tokenizer(folder)


def test_non_qwen_byte_level_bpe_is_refused(tmp_path):
    folder = _tiny_bpe(tmp_path / "t", {"eos_token": "a", "tokenizer_class": "GPT2Tokenizer"})
    with pytest.raises(ValueError, match="GPT2Tokenizer"):
        load_tokenizer(folder)
