"""Tokenizers, document sources, the token stream and the packed-batch loader (CPU only)."""

import json

import pytest
import torch

from components.train.data import TokenBatchLoader, build_token_stream
from components.errors import UserError
from components.train.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

DOCS = ["hello world", "héllo ünïcode ✓", "third document\nwith two lines"]


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_specials():
    tok = build_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    assert isinstance(build_tokenizer(""), ByteTokenizer) and isinstance(build_tokenizer("bytes"), ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.get_vocab_size()) == (256, 257, 258)
    text = DOCS[1]
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and all(0 <= i < 256 for i in ids[1:-1])
    assert tok.decode(ids) == text
    assert tok.encode_to_array(text).tolist() == ids[1:-1]
    assert tok.decode([0xFF]) == "\ufffd"


def _save_hf_tokenizer(directory, with_config: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "<|endoftext|>": 4, "<s>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>", "<|endoftext|>", "<s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if with_config:
        config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer_from_dir_and_file(tmp_path):
    d = _save_hf_tokenizer(tmp_path / "plain", with_config=False)
    for path in (str(d), str(d / "tokenizer.json")):
        tok = build_tokenizer(path)
        assert isinstance(tok, HFTokenizer)
        assert tok.get_vocab_size() == 6
        assert tok.eos_id == 4 and tok.bos_id == 5  # <|endoftext|> wins over </s> without a config
        ids = tok.encode("hello world", add_bos=True, add_eos=True)
        assert ids == [5, 1, 2, 4]
        assert tok.decode(ids) == "hello world"
        assert tok.encode_to_array("world hello").tolist() == [2, 1]
        assert [a.tolist() for a in tok.encode_batch_to_arrays(["hello", "world"])] == [[1], [2]]


def test_hf_tokenizer_specials_from_config(tmp_path):
    tok = build_tokenizer(str(_save_hf_tokenizer(tmp_path / "cfg", with_config=True)))
    assert tok.eos_id == 3 and tok.bos_id == 5


def test_tokenizer_errors_are_one_line(tmp_path):
    missing = str(tmp_path / "nope" / "tok")
    with pytest.raises(UserError) as e:
        build_tokenizer(missing)
    assert missing in _one_line(e) and "tokenizer.json" in str(e.value)

    bad = tmp_path / "bad.json"
    bad.write_text("{ this is not\n a tokenizer")
    with pytest.raises(UserError) as e:
        build_tokenizer(str(bad))
    assert str(bad) in _one_line(e)


# ---- token stream -------------------------------------------------------------------------------


def test_stdlib_corpus_deterministic_and_capped():
    tok = ByteTokenizer()
    a = build_token_stream("python_stdlib", None, tok, max_bytes=200_000)
    b = build_token_stream("python_stdlib", "", tok, max_bytes=200_000)
    assert a.dtype == torch.int32 and a.dim() == 1
    assert torch.equal(a, b)
    n_docs = int((a == tok.eos_id).sum())
    assert n_docs > 1 and a[-1] == tok.eos_id
    assert 190_000 < a.numel() - n_docs <= 200_000


def _expected_stream(tok):
    return torch.tensor([i for d in DOCS for i in tok.encode(d, add_eos=True)], dtype=torch.int32)


def test_local_formats_give_same_stream(tmp_path):
    tok = ByteTokenizer()
    expected = _expected_stream(tok)

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet)

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text(json.dumps({"text": DOCS[0]}) + "\n")
    pq.write_table(pa.table({"text": DOCS[1:]}), shards / "b.parquet")

    import datasets

    hf = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(hf))
    hf_dict = tmp_path / "hf_dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": DOCS}), "test": datasets.Dataset.from_dict({"text": ["x"]})}
    ).save_to_disk(str(hf_dict))

    for path in (jsonl, parquet, shards, hf, hf_dict):
        stream = build_token_stream("local", str(path), tok)
        assert torch.equal(stream, expected), path


def test_local_with_hf_tokenizer(tmp_path):
    tok = build_tokenizer(str(_save_hf_tokenizer(tmp_path / "tok", with_config=False)))
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": d}) for d in ["hello world", "world"]))
    stream = build_token_stream("local", str(path), tok, text_field="body")
    assert stream.tolist() == [1, 2, 4, 2, 4]


def test_stream_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(UserError) as e:
        build_token_stream("foo", None, tok)
    assert "[training] dataset = 'foo'" in _one_line(e)

    with pytest.raises(UserError) as e:
        build_token_stream("local", None, tok)
    assert "dataset_path" in _one_line(e)

    missing = str(tmp_path / "nope")
    with pytest.raises(UserError) as e:
        build_token_stream("local", missing, tok)
    assert f"[training] dataset_path = {missing!r} does not exist" in _one_line(e)

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(UserError) as e:
        build_token_stream("local", str(jsonl), tok)
    assert "text field 'text' not found" in _one_line(e) and str(jsonl) in str(e.value)

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": ["x"]}), parquet)
    with pytest.raises(UserError) as e:
        build_token_stream("local", str(parquet), tok)
    assert "text field 'text' not found" in _one_line(e) and str(parquet) in str(e.value)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError) as e:
        build_token_stream("local", str(empty), tok)
    assert str(empty) in _one_line(e)


# ---- batch loader -------------------------------------------------------------------------------


def _tokens(n=1000):
    return torch.arange(n, dtype=torch.int32)


def test_loader_labels_are_shifted_inputs():
    loader = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=3)
    for _ in range(20):  # crosses epoch boundaries (62 windows -> 15 batches per epoch)
        inputs_BS, labels_BS = loader.next_batch()
        assert inputs_BS.shape == labels_BS.shape == (4, 16) and inputs_BS.dtype == torch.int64
        assert torch.equal(labels_BS, inputs_BS + 1)  # arange stream: label is the next token
        assert torch.all(inputs_BS[:, 0] % 16 == 0)  # windows start at multiples of seq_len
    assert loader.epoch == 1


def test_loader_ranks_partition_global_batch():
    full = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=7)
    ranks = [TokenBatchLoader(_tokens(), batch_size=2, seq_len=16, rank=r, world_size=2, seed=7) for r in range(2)]
    for _ in range(10):
        x_full, y_full = full.next_batch()
        (x0, y0), (x1, y1) = (r.next_batch() for r in ranks)
        assert not set(x0[:, 0].tolist()) & set(x1[:, 0].tolist())
        assert torch.equal(torch.cat([x0, x1]), x_full) and torch.equal(torch.cat([y0, y1]), y_full)


def test_loader_resume_is_exact():
    ref = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=1)
    stream = [ref.next_batch() for _ in range(40)]  # 15 batches per epoch: two epoch boundaries
    for stop in (0, 5, 14, 15, 16, 29):
        first = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=1)
        for _ in range(stop):
            first.next_batch()
        sd = first.state_dict()
        assert set(sd) == {"epoch", "position"}
        resumed = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=1)
        resumed.load_state_dict(sd)
        for (x, y), (x_ref, y_ref) in zip((resumed.next_batch() for _ in range(40 - stop)), stream[stop:]):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_loader_epochs_differ_and_cover_windows():
    loader = TokenBatchLoader(_tokens(), batch_size=4, seq_len=16, seed=0)
    epochs = [[loader.next_batch()[0] for _ in range(loader.batches_per_epoch)] for _ in range(2)]
    starts = [torch.cat(e)[:, 0].tolist() for e in epochs]
    assert starts[0] != starts[1]
    assert len(set(starts[0])) == len(starts[0]) == 60  # 62 windows, tail of 2 dropped


def test_loader_too_small():
    with pytest.raises(UserError) as e:
        TokenBatchLoader(_tokens(100), batch_size=4, seq_len=16, world_size=2)
    msg = _one_line(e)
    assert msg.startswith("dataset too small: 100 tokens give 6 sequences of seq_len 16") and "4*2" in msg
