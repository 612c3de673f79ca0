"""The accelerators a worker announces, and the check of a stage's device before setup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline._devices import visible_devices


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    """A device directory as a host with two NVIDIA GPUs has it (control files included)."""
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null"):
        (tmp_path / name).touch()
    return tmp_path


def test_this_host_announces_what_torch_sees() -> None:
    """Without importing torch, the worker announces as many CUDA devices as torch finds."""
    assert len(visible_devices()) == torch.cuda.device_count()


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        (None, ["cuda:0", "cuda:1"]),
        ("1", ["cuda:0"]),
        ("1,0", ["cuda:0", "cuda:1"]),
        ("", []),
        ("-1", []),
        ("0,5,1", ["cuda:0"]),  # CUDA stops at the first index it has no device for
        ("0,0", ["cuda:0"]),  # ... and at a repeat
        ("GPU-8f2b1c7e", ["cuda:0"]),
    ],
)
def test_cuda_visible_devices_narrows_them_as_cuda_does(
    dev: Path, mask: str | None, expected: list[str]
) -> None:
    env = {} if mask is None else {"CUDA_VISIBLE_DEVICES": mask}
    assert visible_devices(dev, env) == expected


def test_a_host_without_nvidia_devices_has_none(tmp_path: Path) -> None:
    (tmp_path / "null").touch()
    assert visible_devices(tmp_path, {"CUDA_VISIBLE_DEVICES": "0"}) == []
    assert visible_devices(tmp_path / "missing", {}) == []


def test_a_stage_on_a_device_this_host_lacks_fails_start_up_saying_so(tmp_path: Path) -> None:
    """A stage placed on a CUDA device this host does not have fails start-up (exit 3) with
    one line naming the stage and the device, before its setup runs."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("stages:\n  e: {impl: 'tests.pipeline.sample_stages:Echo', device: 'cuda:64'}\n")
    res = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", str(cfg), "--input", '{"value": "a"}'],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 3, res.stderr
    assert "stage 'e' is placed on 'cuda:64'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
