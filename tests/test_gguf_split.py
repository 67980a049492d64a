"""Split GGUFs (llama.cpp's gguf-split: ``NAME-00001-of-0000N.gguf`` ...), read from the first shard as
llama.cpp reads them: the same config and tensors as the unsplit file, a clear error for another shard
or a missing one, and a converted copy keyed to every shard."""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenleap.errors import ModelFormatError
from tokenleap.models.checkpoint import conversion_key, load_checkpoint
from tokenleap.models.gguf import GGUFFile

from test_gguf import tiny_state, write_tiny_gguf
from test_loader import tokenizer_stub  # noqa: F401 (the fixture)


@pytest.mark.parametrize("arch,qtype", [("llama", Q.F32), ("qwen2", Q.Q8_0)])
def test_a_split_gguf_reads_as_the_whole_file(tmp_path, arch, qtype):
    sd = tiny_state(arch)
    whole = GGUFFile(write_tiny_gguf(tmp_path / "whole.gguf", arch, sd, qtype=qtype))
    first = write_tiny_gguf(tmp_path / "m.gguf", arch, sd, qtype=qtype, split_max_tensors=5)
    count = int(first.name.removesuffix(".gguf").rsplit("-", 1)[1])  # (NAME-00001-of-0000N.gguf)
    assert first.name.startswith("m-00001-of-") and count >= 4
    split = GGUFFile(first)
    assert len(split.shards) == count and {i.file for i in split.infos.values()} == set(range(count))
    assert split.config == whole.config and split.hf_names() == whole.hf_names()
    for name in whole.hf_names():
        assert torch.equal(split.tensor(name), whole.tensor(name)), name
        assert (split.raw_tensor(name)[1] == whole.raw_tensor(name)[1]).all(), name
    assert split.tokenizer_metadata() == whole.tokenizer_metadata()
    split.close()
    assert split._data is None


def test_a_split_gguf_loads_and_converts_keyed_to_every_shard(tmp_path, tokenizer_stub):  # noqa: F811
    sd = tiny_state("llama")
    first = write_tiny_gguf(tmp_path / "m.gguf", "llama", sd, split_max_tensors=7)
    ck = load_checkpoint(first, torch.float32, cache_dir=tmp_path / "cache")
    assert set(ck.weights) == set(sd)
    assert all(torch.equal(ck.weights[n], torch.from_numpy(v)) for n, v in sd.items())
    key = conversion_key(first, torch.float32)
    last = sorted(tmp_path.glob("m-0000*-of-*.gguf"))[-1]
    os.utime(last, ns=(last.stat().st_atime_ns, last.stat().st_mtime_ns + 10**9))  # a later shard replaced
    assert conversion_key(first, torch.float32) != key
    plain = write_tiny_gguf(tmp_path / "plain.gguf", "llama", sd)
    assert conversion_key(plain, torch.float32).startswith("plain-float32-")  # (unsplit: as before)


def test_another_shard_or_a_missing_one_is_a_clear_error(tmp_path):
    first = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_state("llama"), split_max_tensors=7)
    second = first.with_name(first.name.replace("00001-of", "00002-of"))
    with pytest.raises(ModelFormatError, match=r"shard 2 of 3 of a split GGUF: give the first one, .*m-00001-of"):
        GGUFFile(second)
    renamed = first.rename(tmp_path / "renamed.gguf")
    with pytest.raises(ModelFormatError, match="cannot be found"):
        GGUFFile(renamed)
    renamed.rename(first)
    second.unlink()
    with pytest.raises(ModelFormatError, match="m-00002-of-00003.gguf is not beside it"):
        GGUFFile(first)
