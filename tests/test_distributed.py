"""Distributed calibration: windows shared out between ranks, sums reduced on rank 0, checkpoints and resume.

Three tests start real processes talking gloo over 127.0.0.1 (a free port): `kvhandoff fit` under torchrun (whole
and in layer blocks), and a rank that dies mid-pass. The rest run in this process (a single-process `Ranks()` runs
the same code)."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from _dist_support import LOOPBACK, free_port, loopback_env, run_rank
from kvhandoff import FitConfig
from kvhandoff.cli import app
from kvhandoff.config import CalibrationSpec
from kvhandoff.errors import ConfigError, DistributedError
from kvhandoff.fit.distributed import Ranks, collect_shared, gpu_share, launched, window_shares
from kvhandoff.fit.pipeline import collect_statistics
from kvhandoff.fit.statistics import CalibrationStats
from kvhandoff.mapper.mapper import Mapper
from kvhandoff.workflow import load_named_pair, obtain_mapper, obtain_statistics
from kvhandoff.workflow.named_pair import checkpoint_path, statistics_path

from conftest import save_tiny_pair, tiny_model

WINDOWS = 6


@pytest.fixture(scope="module")
def models():
    return tiny_model(layers=2, seed=0), tiny_model(layers=3, head_dim=32, seed=1)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 128, (WINDOWS, 40), generator=torch.Generator().manual_seed(0))


def assert_same_statistics(got: CalibrationStats, expected: CalibrationStats) -> None:
    assert got.count == expected.count
    for a, b in zip(got.sums(), expected.sums(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-9)


def test_windows_are_shared_out_by_index_modulo_the_world_size():
    assert window_shares(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert window_shares([1, 2, 4, 5], 2) == [[1, 4], [2, 5]]  # windows 0 and 3 already reduced
    assert window_shares([0], 2) == [[0], []]


def test_without_torchrun_it_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with launched() as ranks:
        assert (ranks.rank, ranks.world_size, ranks.is_root, ranks.distributed) == (0, 1, True, False)
        assert ranks.broadcast("x", "step") == "x" and ranks.gather(3, "step") == [3]
    with pytest.raises(ConfigError, match="checkpoint_every"):
        Ranks(checkpoint_every=0)
    monkeypatch.setenv("KVHANDOFF_DIST_TIMEOUT", "soon")
    with pytest.raises(DistributedError, match="KVHANDOFF_DIST_TIMEOUT"), launched():
        pass


@pytest.mark.parametrize("target_gram", [False, True])
def test_one_process_pass_equals_collect_statistics(models, windows, target_gram):
    source, target = models
    stats, record = collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=4), batch_size=2,
                                   progress=False, target_gram=target_gram)
    expected = collect_statistics(source, target, list(windows.split(2)), FitConfig(), progress=False,
                                  target_gram=target_gram)
    assert stats.names() == expected.names()
    assert_same_statistics(stats, expected)
    assert record == {"world_size": 1, "windows_per_rank": [list(range(WINDOWS))]}


class Interrupted(Exception):
    pass


def test_an_interrupted_pass_resumes_from_its_checkpoint(models, windows, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvhandoff")
    source, target = models
    checkpoint = tmp_path / "partial.safetensors"
    calls = []

    def interrupt(_module, _inputs):
        calls.append(1)
        if len(calls) == 4:  # the 4th window: rounds of 2 windows, so windows 0-1 are checkpointed
            raise Interrupted

    handle = target.model.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(Interrupted):
            collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=2), checkpoint=checkpoint,
                           progress=False)
    finally:
        handle.remove()
    assert CalibrationStats.read_info(checkpoint)["windows"] == [0, 1]
    stats, record = collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=2),
                                   checkpoint=checkpoint)
    assert "2 window(s) already reduced (0-1)" in caplog.text
    assert record["windows_per_rank"] == [[2, 3, 4, 5]]
    assert record["resumed_from_checkpoint"]["windows"] == [0, 1]
    assert record["resumed_from_checkpoint"]["runs"][0]["world_size"] == 1
    assert_same_statistics(stats, collect_statistics(source, target, list(windows.split(1)), progress=False))
    # a checkpoint of other windows (or settings) is never added in
    caplog.clear()
    other = windows.flip(0)
    stats, record = collect_shared(source, target, other, FitConfig(), Ranks(checkpoint_every=2),
                                   checkpoint=checkpoint)
    assert "starting the pass from the first window" in caplog.text
    assert "resumed_from_checkpoint" not in record
    assert_same_statistics(stats, collect_statistics(source, target, list(other.split(1)), progress=False))


def test_a_checkpoint_resumes_a_pass_only_when_it_holds_what_the_pass_sums(models, windows, tmp_path, caplog):
    source, target = models
    checkpoint = tmp_path / "partial.safetensors"
    collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=2), checkpoint=checkpoint,
                   progress=False)
    stats, record = collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=2),
                                   checkpoint=checkpoint, target_gram=True)  # the checkpoint has no Gram
    assert "starting the pass from the first window" in caplog.text and stats.target_gram
    stats, record = collect_shared(source, target, windows, FitConfig(), Ranks(checkpoint_every=2),
                                   checkpoint=checkpoint)  # rewritten by the pass with the Gram: it serves
    assert record["resumed_from_checkpoint"]["windows"] == list(range(WINDOWS)) and not stats.target_gram
    assert_same_statistics(stats, collect_statistics(source, target, list(windows.split(1)), progress=False))


def _spawn_ranks(port, windows, checkpoint, die_on_call, result):
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(rank, 2, port, windows, str(checkpoint), die_on_call,
                                                        str(result)))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
        if process.is_alive():  # never expected: a hung collective would fail the test, not the suite
            process.kill()
            process.join()
    return [process.exitcode for process in processes]


def test_a_rank_that_dies_fails_the_run_and_a_rerun_resumes(models, windows, tmp_path):
    checkpoint, result = tmp_path / "partial.safetensors", tmp_path / "rank0.txt"
    # rank 1 reads windows 1, 3, 5, one per round; it dies on window 3, in round 2
    codes = _spawn_ranks(free_port(), windows, checkpoint, 2, result)
    message = result.read_text()
    assert codes[1] == 3 and codes[0] == 0, message
    assert message.startswith("DistributedError: rank 0 of 2: reducing round 2 of 3 (windows 2-3) failed"), message
    assert "Re-run the same command to resume" in message and str(checkpoint) in message
    info = CalibrationStats.read_info(checkpoint)
    assert info["windows"] == [0, 1] and info["runs"] == [{"world_size": 2, "windows_per_rank": [[0], [1]]}]
    # the re-run (here in one process) reads only the windows not reduced before
    source, target = models
    stats, record = collect_shared(source, target, windows, FitConfig(), Ranks(), checkpoint=checkpoint,
                                   progress=False)
    assert record["windows_per_rank"] == [[2, 3, 4, 5]] and record["resumed_from_checkpoint"]["windows"] == [0, 1]
    assert_same_statistics(stats, collect_statistics(source, target, list(windows.split(1)), progress=False))


@pytest.fixture
def pair_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return save_tiny_pair(tmp_path)


def test_torchrun_fit_with_two_ranks_equals_one_process(pair_paths, tmp_path, monkeypatch):
    small, large = pair_paths
    calibration = CalibrationSpec(num_sequences=4, seq_len=48)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", LOOPBACK, "--master-port", str(free_port()), "-m", "kvhandoff.cli", "fit",
               "--source", small, "--target", large, "--sequences", "4", "--seq-len", "48",
               "--checkpoint-every", "1", "--dist-timeout", "120", "--out", str(tmp_path / "m2")]
    done = subprocess.run(command, env=loopback_env(KVHANDOFF_HOME=str(tmp_path / "home2")), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "saved" in done.stdout and "rank 1 of 2: done, read 2 calibration window(s)" in done.stderr
    two = Mapper.load(tmp_path / "m2")
    assert two.manifest["calibration"]["world_size"] == 2
    assert two.manifest["calibration"]["windows_per_rank"] == [[0, 2], [1, 3]]

    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home2"))
    pair = load_named_pair(small, large, progress=False)
    distributed_stats = CalibrationStats.load(statistics_path(pair, FitConfig(), calibration))
    assert not checkpoint_path(pair, FitConfig(), calibration).exists()  # removed once the statistics are saved
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home1"))
    one, _, _ = obtain_mapper(pair, FitConfig(), calibration, progress=False)
    assert one.manifest["calibration"]["world_size"] == 1
    assert one.manifest["calibration"]["windows_per_rank"] == [[0, 1, 2, 3]]
    assert_same_statistics(distributed_stats, CalibrationStats.load(statistics_path(pair, FitConfig(), calibration)))

    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = pair.source(ids, use_cache=True).past_key_values
    for a, b in zip(one.transfer(cache).layers, two.transfer(cache).layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-6)


def _transfers(mapper, source, ids):
    with torch.no_grad():
        cache = source(ids, use_cache=True).past_key_values
    return mapper.transfer(cache).layers


def test_torchrun_fit_in_layer_blocks_equals_the_whole_one_process_fit(pair_paths, tmp_path, monkeypatch):
    small, large = pair_paths
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", LOOPBACK, "--master-port", str(free_port()), "-m", "kvhandoff.cli", "fit",
               "--source", small, "--target", large, "--sequences", "4", "--seq-len", "48", "--layer-block", "2",
               "--dtype", "fp32", "--device-map", "auto", "--dist-timeout", "120", "--out", str(tmp_path / "m2")]
    done = subprocess.run(command, env=loopback_env(KVHANDOFF_HOME=str(tmp_path / "home2")), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 of 2: done, read 4 calibration window(s)" in done.stderr  # 2 windows in each of 2 passes
    blocked = Mapper.load(tmp_path / "m2")
    assert blocked.manifest["fit_metrics"]["target_layer_blocks"] == [[0, 1], [2, 2]]
    assert blocked.manifest["calibration"]["windows_per_rank"] == [[0, 2], [1, 3]]
    assert not list((tmp_path / "home2").rglob("stats-*"))  # no statistics kept: only the mapper

    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home1"))
    pair = load_named_pair(small, large, progress=False)
    whole, _, _ = obtain_mapper(pair, FitConfig(), CalibrationSpec(num_sequences=4, seq_len=48), progress=False)
    assert blocked.manifest["selected_layers"] == whole.manifest["selected_layers"]
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    for a, b in zip(_transfers(whole, pair.source, ids), _transfers(blocked, pair.source, ids), strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-6)


def test_settings_that_need_the_rows_are_refused_under_torchrun(pair_paths, monkeypatch):
    small, large = pair_paths
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(app, ["fit", "--source", small, "--target", large, "--method", "mlp"])
    assert result.exit_code == 2 and "without torchrun" in result.output
    monkeypatch.delenv("WORLD_SIZE")
    pair = load_named_pair(small, large, progress=False)
    with pytest.raises(ConfigError, match="distributed calibration collects statistics only"):
        obtain_statistics(pair, FitConfig(), CalibrationSpec(num_sequences=3, seq_len=32), features=True,
                          ranks=Ranks(rank=0, world_size=2))


def test_the_checkpoint_is_keyed_like_the_statistics(pair_paths, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHANDOFF_HOME", str(tmp_path / "home"))
    pair = load_named_pair(*pair_paths, progress=False)
    calibration = CalibrationSpec(num_sequences=3, seq_len=32)
    stats_file, partial = statistics_path(pair, FitConfig(), calibration), checkpoint_path(pair, FitConfig(),
                                                                                          calibration)
    assert partial.parent == stats_file.parent and partial.name == stats_file.name.replace("stats-", "partial-")
    assert checkpoint_path(pair, FitConfig(token_stride=2), calibration) != partial



@pytest.mark.parametrize(("local_rank", "local_world", "gpus", "share"), [
    (0, 1, 8, list(range(8))),  # one rank: every GPU
    (1, 4, 8, [2, 3]),  # 4 ranks on 8 GPUs: two each, consecutive
    (2, 3, 8, [4, 5]),  # 8 // 3 = 2 each; GPUs 6 and 7 unused
    (5, 4, 2, [1]),  # more ranks than GPUs: shared round robin
    (0, 2, 0, []),
])
def test_each_rank_gets_its_own_run_of_the_nodes_gpus(local_rank, local_world, gpus, share):
    assert gpu_share(local_rank, local_world, gpus) == share
