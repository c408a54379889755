import numpy as np
import pytest

from fusedtrain.data import (
    ByteTokenizer,
    DataConfig,
    RandomWindows,
    TokenDataModule,
    build_token_cache,
    load_tokens,
    stdlib_files,
)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # naïve ünïcode"
    assert tok.decode(tok.encode(text)) == text


def test_text_corpus_is_cached_and_windowed(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("hello world, " * 200)
    cfg = DataConfig(source="text", files=[str(corpus)], cache_dir=str(tmp_path / "cache"),
                     batch_size=4)
    path = build_token_cache(cfg)
    assert build_token_cache(cfg) == path  # second call hits the cache
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    assert len(tokens) == 200 * 13 + 1  # the bytes plus one end-of-document token
    dm = TokenDataModule(cfg, seq_len=16, vocab_size=256, seed=0, max_steps=3)
    dm.prepare_data()
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert (x[:, 1:] == y[:, :-1]).all()


def test_windows_are_reproducible_by_index():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = RandomWindows(tokens, 8, 1, 100), RandomWindows(tokens, 8, 1, 100)
    for i in (0, 17, 99):
        assert (a[i][0] == b[i][0]).all()


def test_stdlib_corpus_subset(tmp_path):
    assert any(p.name == "os.py" for p in stdlib_files())
    assert not any("site-packages" in p.parts for p in stdlib_files())
    cfg = DataConfig(source="stdlib", max_files=3, cache_dir=str(tmp_path))
    assert len(load_tokens(cfg, 256, 0)) > 1000


def test_synthetic_tokens_cover_the_vocabulary():
    cfg = DataConfig(source="synthetic", synthetic_tokens=5000)
    t = load_tokens(cfg, 100, 0)
    assert len(t) == 5000 and t.max() < 100


@pytest.mark.parametrize("kwargs,match", [
    (dict(source="text", files=["/nonexistent.txt"]), "does not exist"),
    (dict(source="text"), "data.files"),
    (dict(tokenizer="sentencepiece"), "data.tokenizer"),
    (dict(tokenizer="gpt2"), "bpe_file"),
    (dict(batch_size=0), "batch_size"),
])
def test_bad_data_config(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfg = DataConfig(cache_dir=str(tmp_path), **kwargs)
        load_tokens(cfg, 256, 0)


def test_empty_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_tokens(DataConfig(source="text", files=[str(empty)], cache_dir=str(tmp_path)),
                    256, 0)
