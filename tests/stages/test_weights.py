"""Weights: deterministic generation, the pinned digest, partial loading and verification."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from stages.model import TINY_VLM
from stages.tensorfile import (
    TensorFileError,
    read_header,
    read_tensors,
    write_tensor_file,
)
from stages.weights import (
    STALE_TEMPORARY_S,
    TINY_VLM_DIGEST,
    TINY_VLM_SEED,
    cache_dir,
    default_path,
    ensure_weights,
    generate_state,
    load_decoder,
    load_vision,
    write_weights,
)


@pytest.fixture
def weights(cache_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the generated weights file, safe to corrupt."""
    path = tmp_path / "w.swt"
    shutil.copyfile(cache_dir / default_path().name, path)
    return path


def _tensor_offset(path: Path, name: str) -> int:
    """The absolute byte offset of tensor ``name`` in the file at ``path``."""
    header, _, start = read_header(path)
    return start + header.tensors[name].offset


def _flip(path: Path, at: int) -> None:
    """Invert the byte at offset ``at`` of ``path``."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_generated_weights_match_the_pinned_digest(tmp_path: Path) -> None:
    """Generating from the seed writes a file whose header hashes to TINY_VLM_DIGEST."""
    digest = write_weights(tmp_path / "w.swt", generate_state())
    assert digest == TINY_VLM_DIGEST
    size = (tmp_path / "w.swt").stat().st_size
    assert 1_000_000 < size < 1_500_000


def test_generation_is_bit_for_bit_repeatable(tmp_path: Path) -> None:
    """Two generations write identical files, and another seed writes a different one."""
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    write_weights(a, generate_state())
    write_weights(b, generate_state())
    write_weights(c, generate_state(seed=TINY_VLM_SEED + 1), TINY_VLM, TINY_VLM_SEED + 1)
    assert a.read_bytes() == b.read_bytes()
    assert hashlib.sha256(a.read_bytes()).digest() != hashlib.sha256(c.read_bytes()).digest()


def test_loaded_weights_equal_the_generated_ones(weights: Path) -> None:
    """Every tensor read back equals the generated tensor exactly; norms and biases are set."""
    _, loaded = read_tensors(weights, TINY_VLM_DIGEST)
    expected = generate_state()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert torch.equal(loaded["vision.norm.weight"], torch.ones(TINY_VLM.d_model))
    assert torch.equal(loaded["decoder.layers.0.qkv.bias"], torch.zeros(3 * TINY_VLM.d_model))
    assert 0.2 < float(loaded["decoder.embed.weight"].std()) < 5


def test_each_part_reads_only_its_own_tensors(weights: Path) -> None:
    """A corrupt decoder tensor fails the decoder's load but not the encoder's, which skips it."""
    _flip(weights, _tensor_offset(weights, "decoder.layers.1.fc1.weight") + 5)
    vision = load_vision(weights)
    assert {n for n, _ in vision.named_parameters()} >= {"patch.weight", "proj.weight"}
    with pytest.raises(TensorFileError, match=r"'decoder\.layers\.1\.fc1\.weight' does not match"):
        load_decoder(weights)


def test_loaded_modules_are_frozen_and_on_the_device(weights: Path) -> None:
    """Loaded parts need no gradients and sit on the requested device."""
    decoder = load_decoder(weights, device="cpu")
    assert not any(p.requires_grad for p in decoder.parameters())
    assert {p.device.type for p in decoder.parameters()} == {"cpu"}
    assert not decoder.training


def test_a_changed_header_fails_the_digest_check(weights: Path) -> None:
    """Editing the header (here, a tensor's shape) is caught by the pinned header digest."""
    data = weights.read_bytes()
    patched = data.replace(b'"shape":[64]', b'"shape":[46]', 1)
    assert patched != data
    weights.write_bytes(patched)
    with pytest.raises(TensorFileError, match="header checksum is .* expected " + TINY_VLM_DIGEST):
        load_vision(weights)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: b"NOTMAGIC" + d[8:], "bad magic"),
        (lambda d: d[:12], "truncated file"),
        (lambda d: d[:8] + (2**40).to_bytes(8, "little") + d[16:], "implausible"),
        (lambda d: d[:200], "truncated header"),
        (lambda d: d[:-1000], "is truncated"),
        (lambda d: d.replace(b"tiny-vlm", b"\xf4iny-vlm", 1), "malformed header: 'utf-8'"),
    ],
    ids=["magic", "short", "length", "header", "data", "utf-8"],
)
def test_malformed_files_are_refused_with_a_reason(weights: Path, mangle, message: str) -> None:
    """Bad magic, an absurd header length, truncation and a header that is not UTF-8 (which
    escaped as a UnicodeDecodeError) each raise TensorFileError saying so."""
    weights.write_bytes(mangle(weights.read_bytes()))
    with pytest.raises(TensorFileError, match=message):
        load_decoder(weights)


def test_a_missing_explicit_file_is_generated(tmp_path: Path) -> None:
    """ensure_weights writes a missing file once, and leaves an existing one alone."""
    path = tmp_path / "sub" / "w.swt"
    assert ensure_weights(path) == path
    first = path.stat()
    assert ensure_weights(path) == path
    assert path.stat().st_mtime_ns == first.st_mtime_ns
    assert read_header(path)[1] == TINY_VLM_DIGEST
    assert not list(path.parent.glob("*.tmp"))


def test_a_generation_removes_the_temporaries_of_killed_writes_only(tmp_path: Path) -> None:
    """A write killed before its rename leaves its temporary file (a model's size each, for
    good); the next generation removes those left long ago, and not one being written now
    by a worker starting beside it."""
    path = tmp_path / "w.swt"
    old, fresh, other = (tmp_path / f"{name}.tmp" for name in ("w.swtab12", "w.swtcd34", "x.swt1"))
    for tmp in (old, fresh, other):
        tmp.write_bytes(b"partial")
    long_ago = time.time() - 2 * STALE_TEMPORARY_S
    for tmp in (old, other):
        os.utime(tmp, (long_ago, long_ago))
    assert ensure_weights(path) == path
    assert not old.exists() and fresh.exists() and other.exists()


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """STAGEWIRE_CACHE_DIR wins, then XDG_CACHE_HOME/stagewire, then ~/.cache/stagewire."""
    monkeypatch.setenv("STAGEWIRE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    assert default_path().parent == tmp_path / "explicit"
    assert TINY_VLM_DIGEST[:16] in default_path().name
    monkeypatch.delenv("STAGEWIRE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "stagewire"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "stagewire"


def test_default_loading_generates_into_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no path, the decoder loads from a file generated into the cache directory."""
    monkeypatch.setenv("STAGEWIRE_CACHE_DIR", str(tmp_path))
    decoder = load_decoder()
    assert [p.name for p in tmp_path.iterdir()] == [default_path().name]
    _, tensors = read_tensors(default_path(), TINY_VLM_DIGEST, "decoder.")
    assert torch.equal(decoder.head.weight, tensors["head.weight"])


def test_tensor_files_round_trip_metadata_and_tensors(tmp_path: Path) -> None:
    """Any float32 tensors and JSON metadata come back as written, selected by prefix."""
    tensors = {"a.x": torch.arange(6.0).reshape(2, 3), "b.y": torch.tensor([1.5])}
    digest = write_tensor_file(tmp_path / "t", tensors, {"note": "hi", "n": [1, 2]})
    header, a = read_tensors(tmp_path / "t", digest, "a.")
    assert header.metadata == {"note": "hi", "n": [1, 2]}
    assert a.keys() == {"x"}
    assert torch.equal(a["x"], tensors["a.x"])
    with pytest.raises(TensorFileError, match=r"no tensors under 'c\.'"):
        read_tensors(tmp_path / "t", digest, "c.")


def test_tensor_files_refuse_other_dtypes(tmp_path: Path) -> None:
    """Only float32 tensors are written; anything else is refused before a file appears."""
    with pytest.raises(TensorFileError, match="only float32"):
        write_tensor_file(tmp_path / "t", {"x": torch.zeros(2, dtype=torch.int64)}, {})
    assert not list(tmp_path.iterdir())


def test_the_header_records_the_model_config(weights: Path) -> None:
    """The weights file's metadata names the model, its config and seed."""
    header, _, _ = read_header(weights)
    assert header.metadata["model"] == "tiny-vlm"
    assert header.metadata["seed"] == TINY_VLM_SEED
    assert header.metadata["config"]["decoder_layers"] == TINY_VLM.decoder_layers


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_damaged_cached_weights_are_generated_again(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tmp_path: Path, damage: str
) -> None:
    """The cache holds only what the fixed seed makes: damaged (a flipped bit, a copy cut
    short), it failed every start until deleted by hand, the error not saying so. A file
    given by path is the caller's: it is not overwritten, and the error says what to do."""
    monkeypatch.setenv("STAGEWIRE_CACHE_DIR", str(tmp_path))
    shutil.copyfile(cache_dir / default_path().name, default_path())
    if damage == "truncated":
        default_path().write_bytes(default_path().read_bytes()[:-1000])
    else:
        _flip(default_path(), _tensor_offset(default_path(), "decoder.head.bias"))
    given = tmp_path / "given.swt"
    shutil.copyfile(default_path(), given)
    with pytest.raises(TensorFileError, match="delete it, or pass no path"):
        load_decoder(given)
    with pytest.warns(UserWarning, match="damaged .* generating them again"):
        load_decoder()
    assert default_path().read_bytes() == (cache_dir / default_path().name).read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_cache_dir_that_is_a_file_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It was a bare FileExistsError."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("STAGEWIRE_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(OSError, match=r"cannot write the model's weights .*STAGEWIRE_CACHE_DIR"):
        load_decoder()
