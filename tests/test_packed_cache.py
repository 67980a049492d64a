"""Quantized models kept on disk (``models/packed_cache.py``): the second load of a model reads the
file the first one stored instead of quantizing again, and computes bitwise the same logits; a file
made by other code or for another kernel setup is not read, an unreadable one is rebuilt, and
``TOKENLEAP_PACKED_CACHE=0`` stores nothing."""
from __future__ import annotations

import pytest
import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.models import packed_cache, pretrained, quant
from tokenleap.models.transformer import Segment

IDS = [1, 504, 3458, 28, 1669, 314, 2114, 30, 198, 57]


def logits(model) -> torch.Tensor:  # [len(IDS), vocab]
    cache = KVCache(model.config, 1, len(IDS), model.dtype)
    return model(torch.tensor(IDS), [Segment(cache.allocate(), 0, len(IDS))], cache).logits.float()


def packed_files(tmp_path):
    return sorted((tmp_path / "packed").glob("*.pt"))


@pytest.mark.parametrize("mode", ["int4", "int8"])  # a GGUF's own 4-bit blocks re-packed; float weights quantized
def test_the_second_load_reads_the_first_ones_file(smollm2_gguf, tmp_path, monkeypatch, mode):
    first = pretrained.load_model(smollm2_gguf, quant=mode, cache_dir=tmp_path)
    [stored] = packed_files(tmp_path)
    assert mode in stored.name
    [listed] = packed_cache.stored(smollm2_gguf, tmp_path)  # what `tokenleap models` shows
    assert (listed["quant"], listed["bytes"], listed["path"]) == (mode, stored.stat().st_size, str(stored))
    assert listed["others"] == "int8"  # the GGUF's other tensors as a target keeps them (a draft: int4)

    def refused(*a, **k):
        raise AssertionError("quantized again")
    monkeypatch.setattr(quant, "quantize_from_gguf_", refused)
    monkeypatch.setattr(quant, "quantize_", refused)
    second = pretrained.load_model(smollm2_gguf, quant=mode, cache_dir=tmp_path)
    assert torch.equal(logits(first.model), logits(second.model))
    monkeypatch.undo()
    monkeypatch.setenv("TOKENLEAP_PACKED_CACHE", "0")  # quantized afresh, nothing stored
    fresh = pretrained.load_model(smollm2_gguf, quant=mode, cache_dir=tmp_path / "off")
    assert torch.equal(logits(fresh.model), logits(second.model)) and not packed_files(tmp_path / "off")


def test_files_of_other_code_or_kernels_are_not_read_and_a_torn_one_is_rebuilt(smollm2_gguf, tmp_path, monkeypatch,
                                                                              caplog):
    ref = logits(pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path).model)
    [old] = packed_files(tmp_path)
    monkeypatch.setattr(packed_cache, "_code_hash", lambda: "other code")
    pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    [new] = packed_files(tmp_path)  # the other code's file replaced it
    assert new != old
    if kernels.available():  # the kernels off: another layout, another file
        with monkeypatch.context() as m:
            m.setattr(kernels, "available", lambda: False)
            off = packed_cache.build_digest()
        assert off != packed_cache.build_digest()
    new.write_bytes(b"not a model")
    again = pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert "could not be read" in caplog.text and torch.equal(logits(again.model), ref)
    [rebuilt] = packed_files(tmp_path)
    assert rebuilt.stat().st_size > 1000


def test_a_model_that_cannot_be_stored_still_loads(smollm2_gguf, tmp_path, monkeypatch, caplog):
    def unpicklable(*a, **k):
        raise TypeError("cannot pickle 'CDLL' object")
    monkeypatch.setattr(torch, "save", unpicklable)
    loaded = pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert "could not keep the quantized model" in caplog.text and not packed_files(tmp_path)
    assert not list((tmp_path / "packed").glob("*.tmp"))
    monkeypatch.undo()
    assert torch.equal(logits(loaded.model), logits(pretrained.load_model(smollm2_gguf, quant="int4",
                                                                          cache_dir=tmp_path).model))


def test_listing_packed_copies_compiles_no_kernels(tmp_path, monkeypatch):
    """``tokenleap models`` lists packed copies without building the kernels: in a cache where they were
    never built, ``ready`` is False and nothing is listed (nor compiled); once built, copies are read."""
    from tokenleap.kernels import compiler
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path))
    monkeypatch.delitem(kernels._state, "reason", raising=False)
    assert not compiler.built() and not kernels.ready()

    def no_build(*a, **k):
        raise AssertionError("the kernels were compiled to list packed copies")
    monkeypatch.setattr(compiler, "build", no_build)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert packed_cache.stored(gguf, tmp_path) == []
    (compiler.directory_for(compiler.SOURCES) / "tokenleap_kernels.so").write_bytes(b"")
    assert compiler.built() and kernels.ready()


def test_bytes_changed_on_disk_or_another_models_file_are_found_and_rebuilt(smollm2_gguf, tmp_path, caplog):
    """A copy whose bytes changed after it was written (its zip members' CRC-32s no longer match) and one
    copied over it from another quantization are refused, then quantized again: never loaded silently."""
    ref = logits(pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path).model)
    [path] = packed_files(tmp_path)
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2  # inside the largest tensor's data
    raw[at:at + 64] = bytes(b ^ 0x5A for b in raw[at:at + 64])
    path.write_bytes(bytes(raw))
    again = pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert "CRC-32" in caplog.text and torch.equal(logits(again.model), ref)
    caplog.clear()
    pretrained.load_model(smollm2_gguf, quant="int8", cache_dir=tmp_path / "other")
    [int8] = packed_files(tmp_path / "other")
    path.write_bytes(int8.read_bytes())  # another quantization's copy under this one's name
    again = pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert "another model or quantization" in caplog.text and torch.equal(logits(again.model), ref)
    assert packed_cache.load(path) is not None  # (rebuilt, stamped: read as it is from now on)


def test_a_read_only_cache_loses_the_copy_only(smollm2_gguf, tmp_path, monkeypatch, caplog):
    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(torch, "save", read_only)
    monkeypatch.setattr(packed_cache.Path, "unlink", read_only)
    loaded = pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert "could not keep the quantized model" in caplog.text and loaded.model is not None


def test_a_store_removes_the_temp_files_of_stores_killed_mid_save(smollm2_gguf, tmp_path):
    """A process killed while saving leaves its temp file (a model's size): the next store removes it
    once its process is gone and it is old, and leaves a live or recent one's alone."""
    import os
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    packed = tmp_path / "packed"
    packed.mkdir()
    orphan, young = packed / f"m-int4.pt.{dead.pid}.tmp", packed / f"n-int4.pt.{dead.pid}.tmp"
    live = packed / f"m-int4.pt.{os.getpid()}.tmp"
    for f in (orphan, young, live):
        f.write_bytes(b"x" * 100)
    for f in (orphan, live):
        os.utime(f, (1, 1))  # (old)
    pretrained.load_model(smollm2_gguf, quant="int4", cache_dir=tmp_path)
    assert not orphan.exists() and young.exists() and live.exists() and len(packed_files(tmp_path)) == 1
