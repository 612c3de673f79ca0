"""``Pipeline.connect(..., device=...)`` and ``stagewire submit --device``: a remote client
names where output tensors land.

The master is a real ``stagewire master`` process with its worker, serving on a loopback
port; its stage's output type lives in a module only the master's processes import, so the
client decodes untyped, as one on another host does. This host may have no GPU, so the one
test of outputs sent from a GPU the client lacks has a fake master send them: a plain ZMQ
ROUTER speaking the protocol, whose output records name that GPU.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import torch

from pipeline import ConfigError, PayloadError, Pipeline
from pipeline._codec import _REF_DECODER, _REF_ENCODER, codec_for
from pipeline._messages import Output, Welcome, encode_message
from stages.text import Text
from tests.pipeline.conftest import grid_module, spec, wait_for, workers_announced
from tests.pipeline.tensor_stages import FACTORS, Frame
from tests.pipeline.test_connect_failures import FakeMaster
from tests.procs import ROOT, free_port, kill_all, start_stagewire

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: A CUDA device this process cannot use: cuda:0 without CUDA, one past the last with it.
MISSING = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:0"

GRID_MODULE = grid_module("bfloat16")

GRID = """\
name: grid
stages:
  grid: {impl: "device_grid_stages:Gridify"}
edges: []
"""


def _cells(n: int) -> torch.Tensor:
    """What Gridify sends for a text of ``n`` characters."""
    return torch.arange(2 * n, dtype=torch.bfloat16).reshape(n, 2)


@dataclass
class Served:
    endpoint: str
    env: dict[str, str]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grid(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    """A ``stagewire master`` serving GRID, and its worker, both able to import the stage's
    module; this process cannot."""
    tmp = tmp_path_factory.mktemp("grid")
    extra = tmp / "extra"
    extra.mkdir()
    (extra / "device_grid_stages.py").write_text(GRID_MODULE)
    config = tmp / "grid.yaml"
    config.write_text(GRID)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra), str(ROOT)])}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    err = tmp / "master.err"
    procs = [start_stagewire("master", str(config), "--bind", endpoint, err=err, env=env)]
    try:
        text = await workers_announced(err)
        for command in re.findall(r"stagewire worker (--master \S+ --stage \S+ --replica \d+)",
                                  text):  # fmt: skip
            procs.append(
                start_stagewire("worker", *command.split(), "--headless",
                                err=tmp / "worker.err", env=env)
            )  # fmt: skip

        def serving() -> bool:
            return "serving " in err.read_text(errors="replace")

        await wait_for(serving, timeout=60)
        yield Served(endpoint, env)
    finally:
        kill_all(procs)


async def test_outputs_land_on_the_device_the_client_names(grid: Served) -> None:
    """A client connected with ``device="meta"`` gets a real master's output tensors on meta
    (dtype and shape kept), one with ``device="cpu"`` gets their values on the CPU, as one
    naming no device does for tensors sent from the CPU."""
    with pytest.raises(ImportError):
        __import__("device_grid_stages")
    async with Pipeline.connect(grid.endpoint, device="meta") as pipe:
        assert pipe.device == "meta"
        out = await pipe.submit(Text("abc"))
        assert out["label"] == "abc"
        assert out["cells"].is_meta
        assert (out["cells"].dtype, out["cells"].shape) == (torch.bfloat16, (3, 2))
    for device in ("cpu", "cpu:0", None):
        async with Pipeline.connect(grid.endpoint, device=device) as pipe:
            out = await pipe.submit(Text("abcd"))
            assert out["cells"].device == torch.device("cpu"), device
            assert torch.equal(out["cells"], _cells(4)), device


async def test_submit_decodes_outputs_onto_the_device_given(grid: Served) -> None:
    """``stagewire submit --device cpu`` is served by a real master and prints the output,
    its tensor summarised."""
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pipeline", "submit", "--master", grid.endpoint,
         "--input", '{"value": "ab"}', "--device", "cpu", "--timeout", "30"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT, env=grid.env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = msgspec.json.decode(proc.stdout.strip())
    assert out == {"label": "ab", "cells": {"dtype": "torch.bfloat16", "shape": [2, 2]}}


async def test_an_unusable_device_is_refused_before_connecting() -> None:
    """A device that is none, or one this host lacks, is a one-line ConfigError from
    ``Pipeline.connect`` itself, and exit 2 with one line from ``stagewire submit``, before
    any master is asked (none listens here)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    for device in ("gpu", MISSING):
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            Pipeline.connect(endpoint, device=device)
        assert time.monotonic() - t0 < 5
        assert str(info.value).startswith(f"device {device!r} ")
        assert "pass 'cpu'" in str(info.value) and "\n" not in str(info.value)
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "pipeline", "submit", "--master", endpoint,
             "--input", '{"value": "x"}', "--device", device],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert line.startswith(f"error: --device: device {device!r} "), line
        assert "pass 'cpu'" in line and "\n" not in line


class GpuMaster(FakeMaster):
    """A fake master whose sink sends Frames."""

    def welcome(self) -> Welcome:
        return Welcome("gpu", ["s"], ["s"], "stages.text:Text",
                       {"s": "tests.pipeline.tensor_stages:Frame"}, self.instance)  # fmt: skip


def _frame_sent_from(device: str, frame: Frame) -> tuple[bytes, list[bytearray]]:
    """``frame`` encoded with its tensor's record naming ``device``: header and buffers."""

    def rename(code: int, data: memoryview) -> msgspec.msgpack.Ext:
        ref = msgspec.structs.replace(_REF_DECODER.decode(data), device=device)
        return msgspec.msgpack.Ext(code, _REF_ENCODER.encode(ref))

    encoded = codec_for(Frame).encode(frame)
    header = msgspec.msgpack.encode(msgspec.msgpack.decode(encoded.header, ext_hook=rename))
    return header, [bytearray(memoryview(b)) for b in encoded.buffers]


async def test_a_gpu_output_reaches_a_client_without_that_gpu_on_the_chosen_device() -> None:
    """An output whose tensor was sent from a GPU this client lacks fails its request with a
    PayloadError naming the device by default, and with ``device="cpu"`` arrives as the
    exact Frame on the CPU."""
    port = free_port()
    master = await GpuMaster(port, "one").start()
    want = Frame("f", torch.arange(6, dtype=torch.float32).reshape(2, 3))
    header, buffers = _frame_sent_from(MISSING, want)
    try:
        for device in (None, "cpu"):
            # Each client numbers its requests from 1: this one's first is token 1.
            master.next_output = encode_message(Output(1, "s", header, buffers))
            async with Pipeline.connect(f"tcp://127.0.0.1:{port}", device=device) as remote:
                stream = remote.stream(Text("x"))
                async with asyncio.timeout(10):
                    if device is None:
                        with pytest.raises(PayloadError, match=f"sent from device '{MISSING}'"):
                            await anext(stream)
                        continue
                    got = await anext(stream)
                await stream.aclose()
            assert isinstance(got, Frame) and got.name == "f"
            assert got.pixels.device == torch.device("cpu")
            assert got.pixels.dtype == torch.float32 and torch.equal(got.pixels, want.pixels)
    finally:
        await master.aclose()


async def test_an_embedded_pipeline_lands_outputs_on_the_device_it_names(tmp_path: Path) -> None:
    """``Pipeline(spec, device=...)`` and ``Pipeline.from_yaml(..., device=...)`` take the
    remote client's option: every output tensor of a real worker lands there (meta: dtype
    and shape kept; cpu: the values). A device that is none, or one this host lacks, is a
    ConfigError from the constructor, before anything starts."""
    stages = {"scale": "tests.pipeline.tensor_stages:Scale"}
    pixels = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    for device in ("gpu", MISSING):
        with pytest.raises(ConfigError, match="pass 'cpu'"):
            Pipeline(spec(stages, []), device=device)
    async with Pipeline(spec(stages, []), device="meta") as pipe:
        assert pipe.device == "meta"
        got = [frame async for frame in pipe.stream(Frame("f", pixels))]
        assert [f.name for f in got] == [f"f*{k}" for k in FACTORS]
        assert all(f.pixels.is_meta and f.pixels.shape == (2, 3) for f in got)
        assert all(f.pixels.dtype == torch.bfloat16 for f in got)
    config = tmp_path / "scale.yaml"
    config.write_text(f"stages:\n  scale: {{impl: {stages['scale']!r}}}\nedges: []\n")
    async with Pipeline.from_yaml(config, device="cpu") as pipe:
        got = [frame async for frame in pipe.stream(Frame("f", pixels))]
        assert all(torch.equal(f.pixels, pixels * k) for f, k in zip(got, FACTORS, strict=True))
