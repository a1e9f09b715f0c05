"""The decoder's default KV budget on a GPU, alone and with other replicas on the same GPU."""

from __future__ import annotations

from common.config import Config
from workers.decoder.worker import shared_kv_budget

GIB = 2**30


def test_one_replica_takes_its_fraction_of_what_is_free() -> None:
    cfg = Config()
    assert shared_kv_budget(cfg, gpu=0, visible=1, free=100 * GIB, total=140 * GIB, own=5 * GIB) == 80 * GIB
    cfg.decoder.replicas = 2  # on two GPUs, one each: nothing shared
    assert shared_kv_budget(cfg, gpu=1, visible=2, free=100 * GIB, total=140 * GIB, own=5 * GIB) == 80 * GIB


def test_replicas_on_one_gpu_split_it_whoever_starts_first() -> None:
    cfg = Config()
    cfg.decoder.replicas, cfg.decoder.replica_gpus = 2, [0, 0]
    # First to ask: nearly all free; second: after the first took its share. The same budget either way.
    first = shared_kv_budget(cfg, gpu=0, visible=1, free=130 * GIB, total=140 * GIB, own=5 * GIB)
    second = shared_kv_budget(cfg, gpu=0, visible=1, free=130 * GIB - first - 5 * GIB, total=140 * GIB, own=5 * GIB)
    assert first == second == int(140 * GIB * 0.8 / 2) - 5 * GIB
    assert first + second + 2 * 5 * GIB <= 0.8 * 140 * GIB
    # Less free than the share (another process holds memory): no more than what is there to take.
    assert shared_kv_budget(cfg, gpu=0, visible=1, free=40 * GIB, total=140 * GIB, own=5 * GIB) == 32 * GIB


def test_more_replicas_than_gpus_wrap_round_and_share() -> None:
    cfg = Config()
    cfg.decoder.replicas = 3  # replica r on GPU r, with two visible: replicas 0 and 2 share GPU 0
    assert shared_kv_budget(cfg, gpu=0, visible=2, free=130 * GIB, total=140 * GIB, own=0) == int(140 * GIB * 0.4)
    assert shared_kv_budget(cfg, gpu=1, visible=2, free=130 * GIB, total=140 * GIB, own=0) == 104 * GIB


def test_the_gpu_embedding_pool_comes_out_of_the_kv_share_allocated_yet_or_not() -> None:
    cfg = Config()
    pool, own, total = 4 * GIB, 5 * GIB, 140 * GIB
    free = total - own  # (nothing else on the GPU yet)
    before = shared_kv_budget(cfg, gpu=0, visible=1, free=free, total=total, own=own, pool=pool)
    after = shared_kv_budget(cfg, gpu=0, visible=1, free=free - pool, total=total, own=own, pool=pool)
    assert before == after == int(total * 0.8) - pool - own  # the daemon may allocate it before or after us
    assert before + own + pool <= 0.8 * total
