import json
import string

import pytest

from dare_core.models.tokenizer import EOT, MASK, SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer

EXPECTED_CHAT = "<|startoftext|>12+3=<|eot_id|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_round_trip_plain_text(tok):
    text = "Hello,  world!\n12+345=357 ~{}[]" + string.punctuation
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per char, no bos/eos added
    assert tok.decode(ids) == text


def test_specials_are_single_tokens(tok):
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1
    ids = tok.encode(f"a{EOT}b")
    assert ids[1] == tok.eot_token_id and len(ids) == 3
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == f"a{EOT}b"


def test_special_ids(tok):
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.mask_token_id == tok.encode(MASK)[0] != tok.pad_token_id
    assert tok.special_token_ids == {tok.encode(s)[0] for s in SPECIAL_TOKENS}
    assert tok.vocab_size == 96 + len(SPECIAL_TOKENS)


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": " 12+3= "}])
    assert text == EXPECTED_CHAT
    assert tok.encode(text)[0] == tok.bos_token_id


def test_reload_gives_identical_encodings(tok_dir, tok):
    again = load_tokenizer(tok_dir)
    text = EXPECTED_CHAT + "42<|endoftext|>"
    assert again.encode(text) == tok.encode(text)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["pad_token"] == config["eos_token"] == "<|endoftext|>"
    assert (tok_dir / "special_tokens_map.json").is_file()


def test_unknown_character_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("a\tb")


def test_missing_file_names_it(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path / "partial")


def test_pad_equal_to_mask_is_rejected(tmp_path, tok_dir):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["pad_token"] = MASK
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pad token id == mask token id"):
        load_tokenizer(folder)
