from tokenizers import Tokenizer, models, pre_tokenizers

from roboscale.models.tokenizer import TaskTokenizer


def test_trained_tokenizer_is_case_insensitive_and_round_trips(tmp_path):
    tok = TaskTokenizer.train(["Open a drawer", "Rotate the faucet clockwise"], vocab_size=300)
    assert tok.encode("OPEN a   drawer") == tok.encode("open a drawer")  # lower-casing lives in tokenizer.json
    tok.save(tmp_path / "tokenizer.json")
    again = TaskTokenizer.from_file(tmp_path / "tokenizer.json")
    assert again.encode("Rotate_the faucet") == tok.encode("rotate the faucet")
    ids, mask = again.encode_batch(["open a drawer", "rotate the faucet counter-clockwise"], max_length=4)
    assert ids.shape == (2, 4) and mask[0].sum() <= 4 and mask[1].all()  # truncated to max_length


def test_a_foreign_tokenizer_json_keeps_case_and_its_special_tokens(tmp_path):
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "Open": 3, "open": 4, "a": 5, "drawer": 6, "[UNK]": 7}
    foreign = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    foreign.pre_tokenizer = pre_tokenizers.Whitespace()
    foreign.save(str(tmp_path / "paligemma_like.json"))
    tok = TaskTokenizer.from_file(tmp_path / "paligemma_like.json")
    assert (tok.pad_id, tok.bos_id) == (0, 2)
    assert tok.encode("Open a drawer") == [2, 3, 5, 6]
    assert tok.encode("open a drawer") == [2, 4, 5, 6]
