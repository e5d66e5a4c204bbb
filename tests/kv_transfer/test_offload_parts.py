"""The OffloadingConnector's parts on their own: --kv-transfer-config refuses what it does
not implement by name, block files detect every kind of damage, and the worker side moves
a block's bytes out of one cache and back into another exactly (float32, float16, fp8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from aiolm import LLM
from aiolm.core.step import CachedRequestData, KVTransferOps, SchedulerOutput
from aiolm.kv_transfer.block_files import BlockFileError, existing_blocks, rank_dir, read_block, write_block
from aiolm.kv_transfer.config import parse_kv_transfer_config
from aiolm.kv_transfer.offload_worker import OffloadWorker

FP = "0123456789abcdef0123456789abcdef"


def config(**extra) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ('{"kv_connector": "NixlConnector"}', "kv_connector: 'NixlConnector' is not supported"),
        ('{"kv_connector": "OffloadingConnector", "kv_ip": "1.2.3.4"}', "kv_ip not supported"),
        ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}', "its role is kv_both"),
        (config(cpu_bytes=10, num_gpu_blocks=3), "num_gpu_blocks not supported by OffloadingConnector"),
        (config(cpu_bytes=-1), "cpu_bytes: must be an integer >= 0"),
        (config(disk_path="/tmp/x"), "disk_bytes: needed with disk_path"),
        (config(), "needs room"),
        (config(cpu_bytes=1, num_cpu_blocks=2), "num_cpu_blocks or cpu_bytes, not both"),
        # accepted and unused before
        (config(cpu_bytes=10, disk_bytes=100), "disk_bytes: caps a disk tier; give disk_path"),
        ('{"kv_connector": "OffloadingConnector", "engine_id": "a"}', "engine_id not supported"),
    ],
)
def test_bad_config_is_refused_naming_the_key(text, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(text)


def test_a_disk_path_that_cannot_be_a_directory_fails_before_the_start(tmp_path):
    """The workers found it out only once the model was loaded, in a traceback."""
    from aiolm.config import EngineArgs
    from aiolm.engine.async_engine import check_model_args

    a_file = tmp_path / "file"
    a_file.write_text("")
    for path in ("/proc/aiolm-kv", str(a_file), str(a_file / "under")):
        args = EngineArgs(kv_transfer_config=config(disk_path=path, disk_bytes=1 << 20))
        with pytest.raises(ValueError, match=r"disk_path: cannot use .* as a directory"):
            check_model_args(args)
    check_model_args(EngineArgs(kv_transfer_config=config(disk_path=str(tmp_path / "new" / "dir"), disk_bytes=1 << 20)))
    assert (tmp_path / "new" / "dir").is_dir()


def test_config_sizes():
    cfg = parse_kv_transfer_config(config(cpu_bytes=1000, disk_path="/d", disk_bytes=5000))
    assert cfg is not None and cfg.cpu_blocks(300) == 3 and cfg.disk_bytes == 5000
    assert parse_kv_transfer_config(config(num_cpu_blocks=7)).cpu_blocks(300) == 7  # type: ignore[union-attr]
    assert parse_kv_transfer_config(None) is None


def test_engine_refuses_offloading_without_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(enable_prefix_caching=False, kv_transfer_config=config(num_cpu_blocks=4))


def test_a_host_tier_under_one_block_is_refused_at_the_start():
    """cpu_bytes below one block made a host tier the scheduler never filled nor dropped
    from, while the workers kept every block saved: their memory grew without end."""
    with pytest.raises(ValueError, match=r"cpu_bytes 1000 holds no KV block of this model \(\d+ bytes a block\)"):
        LLM(executor="local", max_model_len=64, kv_transfer_config=config(cpu_bytes=1000))


def test_a_disk_tier_under_one_block_file_is_refused_at_the_start(tmp_path):
    """The same for disk_bytes: every block was written, none tracked or deleted."""
    with pytest.raises(ValueError, match=r"disk_bytes 1000 holds no KV block file of this model"):
        LLM(executor="local", max_model_len=64, kv_transfer_config=config(disk_path=str(tmp_path), disk_bytes=1000))


def test_block_files_detect_damage(tmp_path):
    h, other = bytes(range(32)), bytes(range(1, 33))
    payload = bytes(range(256)) * 8
    path = tmp_path / "b.kv"
    write_block(path, FP, h, payload)
    assert bytes(read_block(path, FP, h, len(payload))) == payload
    with pytest.raises(BlockFileError, match="another model, layout or block"):
        read_block(path, FP, other, len(payload))
    with pytest.raises(BlockFileError, match="another model, layout or block"):
        read_block(path, "f" * 32, h, len(payload))
    with pytest.raises(BlockFileError, match="holds 2048 bytes of KV, this engine's blocks have 4096"):
        read_block(path, FP, h, 4096)
    data = bytearray(path.read_bytes())
    data[-7] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match="checksum mismatch"):
        read_block(path, FP, h, len(payload))
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(BlockFileError, match="truncated"):
        read_block(path, FP, h, len(payload))
    path.write_bytes(b"AIOLM")
    with pytest.raises(BlockFileError, match="truncated header"):
        read_block(path, FP, h, len(payload))
    with pytest.raises(BlockFileError, match="No such file"):
        read_block(tmp_path / "none.kv", FP, h, len(payload))


def test_existing_blocks_in_write_order(tmp_path):
    d = rank_dir(str(tmp_path), FP, 0)
    d.mkdir(parents=True)
    hashes = [bytes([i]) * 32 for i in (3, 1, 2)]
    for i, h in enumerate(hashes):
        write_block(d / (h.hex() + ".kv"), FP, h, b"x")
        os.utime(d / (h.hex() + ".kv"), ns=(i * 10**9, i * 10**9))
    (d / "junk.kv").write_bytes(b"")
    fresh, old = d / ("ab" * 32 + ".kv.1234.tmp"), rank_dir(str(tmp_path), FP, 1) / ("cd" * 32 + ".kv.5678.tmp")
    old.parent.mkdir()
    fresh.write_bytes(b"")
    old.write_bytes(b"x" * 100)
    os.utime(old, (time.time() - 3600,) * 2)
    assert existing_blocks(str(tmp_path), FP) == hashes
    assert existing_blocks(str(tmp_path), "f" * 32) == []
    # a killed engine's half-written files go (any rank's); one being written now stays
    assert fresh.exists() and not old.exists()


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    """A full disk (here a file-size limit) failed the write and kept its part-written
    temporary file, which held the space the next write needed, for good."""
    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from aiolm.kv_transfer.block_files import write_block\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    write_block(Path(sys.argv[1]) / 'b.kv', '{FP}', b'\\x01' * 32, b'x' * 100_000)\n"
        "except OSError as e:\n"
        "    print('failed:', e.strerror)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("failed:"), (out.stdout, out.stderr)
    assert list(tmp_path.iterdir()) == []


def _step(n: int, ops: KVTransferOps | None) -> SchedulerOutput:
    return SchedulerOutput(n, [], CachedRequestData(), {}, 0, set(), kv_ops=ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_worker_moves_blocks_exactly(tmp_path, dtype, tier):
    """Blocks saved from one cache load back into other blocks bit for bit, a step later."""
    torch.manual_seed(0)
    shape = (2, 6, 4, 2, 8)  # K/V, blocks, block size, KV heads, head dim
    caches = [torch.randn(shape).to(dtype) for _ in range(3)]
    cfg = parse_kv_transfer_config(
        config(num_cpu_blocks=4) if tier == "host" else config(disk_path=str(tmp_path), disk_bytes=10**6)
    )
    assert cfg is not None
    worker = OffloadWorker(cfg, FP, 0, caches)
    originals = [c.clone() for c in caches]
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    worker.begin_step(_step(1, KVTransferOps(save_block_ids=[1, 3], save_hashes=[h1, h2])))
    # kept blocks lie in the tier's own slab of 4 blocks: a view of the step's buffer kept
    # all of that buffer alive
    slab = worker._slab.untyped_storage()
    assert slab.nbytes() == (4 if tier == "host" else 0) * worker.block_bytes
    assert all(b.untyped_storage().data_ptr() == slab.data_ptr() for b in worker.host.values())
    for c in caches:  # the step that evicted them overwrites them
        c[:, 1].zero_()
        c[:, 3].zero_()
    if tier == "disk":
        worker._writer.submit(lambda: None).result()  # the writes are in place
        worker.host.clear()
        assert sorted(p.name[:2] for p in rank_dir(str(tmp_path), FP, 0).iterdir()) == ["01", "02"]
    missing = b"\x09" * 32
    ops = KVTransferOps(load_ids=[7], load_req_ids=["r"], load_hashes=[[h2, h1, missing]], load_block_ids=[[4, 5, 2]])
    worker.begin_step(_step(2, ops))
    assert worker.finished_loads() == {}  # read in the background: copied in at a later step's start
    for n in range(3, 100):
        worker.begin_step(_step(n, None), idle=True)
        done = worker.finished_loads()
        if done:
            break
    assert done == {7: 2}  # the third block was never saved
    for c, o in zip(caches, originals):
        assert torch.equal(c[:, 4].view(torch.uint8), o[:, 3].view(torch.uint8))
        assert torch.equal(c[:, 5].view(torch.uint8), o[:, 1].view(torch.uint8))
        assert torch.equal(c[:, 2].view(torch.uint8), o[:, 2].view(torch.uint8))  # untouched
    worker.close()


def test_the_disk_tier_makes_its_folder_again_if_it_is_deleted(tmp_path):
    """Deleted under a running server, the folder was never made again: every later block
    was lost to 'No such file or directory'."""
    import shutil

    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(2)]
    cfg = parse_kv_transfer_config(config(disk_path=str(tmp_path / "kv"), disk_bytes=10**6))
    assert cfg is not None
    worker = OffloadWorker(cfg, FP, 0, caches)
    folder = rank_dir(str(tmp_path / "kv"), FP, 0)
    shutil.rmtree(tmp_path / "kv")
    worker.begin_step(_step(1, KVTransferOps(save_block_ids=[1], save_hashes=[b"\x05" * 32])))
    worker._writer.submit(lambda: None).result()
    assert [p.name[:2] for p in folder.iterdir()] == ["05"]
    worker.close()


def test_host_slots_are_reused_as_the_scheduler_drops_and_saves():
    """A full host tier: the step that drops one block saves another into its slot; both the
    kept and the new block load back exactly."""
    torch.manual_seed(1)
    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(2)]
    cfg = parse_kv_transfer_config(config(num_cpu_blocks=2))
    assert cfg is not None
    worker = OffloadWorker(cfg, FP, 0, caches)
    originals = [c.clone() for c in caches]
    h1, h2, h3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    worker.begin_step(_step(1, KVTransferOps(save_block_ids=[0, 1], save_hashes=[h1, h2])))
    worker.begin_step(_step(2, KVTransferOps(save_block_ids=[2], save_hashes=[h3], drop_host=[h1])))
    assert sorted(worker.host) == [h2, h3] and not worker._free_slots
    for c in caches:
        c[:, :3].zero_()
    ops = KVTransferOps(load_ids=[1], load_req_ids=["r"], load_hashes=[[h2, h3]], load_block_ids=[[4, 5]])
    worker.begin_step(_step(3, ops))
    for n in range(4, 100):
        worker.begin_step(_step(n, None), idle=True)
        done = worker.finished_loads()
        if done:
            break
    assert done == {1: 2}
    for c, o in zip(caches, originals):
        assert torch.equal(c[:, 4], o[:, 1]) and torch.equal(c[:, 5], o[:, 2])
    worker.close()
